//! Files: private memory maps for reading, vectored writes into temporary files, the
//! one commit that puts them in place, and the locks that tell live writers from dead
//! ones. Knows byte ranges, not tensors.

mod atomic;
pub mod both_ends;
pub mod commit;
mod file_backed;
pub mod in_place;
pub mod locks;
mod mapped;
pub mod page_watch;
mod progress;
mod siblings;
mod writeback;

pub use atomic::{
    pending_temps, pending_temps_of, remove_stale_temps, sync_parent_dir, temp_path_for,
    write_at_parallel, write_segments, PendingFile, TEMP_MARKER,
};
pub use commit::{rename_directory, write_file, CommitOptions, Staged};
pub use file_backed::FileBacked;
pub use locks::{LockFile, PathLock};
pub use mapped::{map_private, map_private_any, open as open_regular, FileId};
pub use progress::Progress;
pub use writeback::{release_clean_cache, AfterEachPiece};
