//! Files: private memory maps for reading, vectored writes into a temporary
//! file that atomically replaces the target. Knows byte ranges, not tensors.

mod atomic;
mod mapped;

pub use atomic::{replace_atomically, temp_path_for, write_at_parallel, write_segments};
pub use mapped::{map_private, map_private_any};
