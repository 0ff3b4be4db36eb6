//! The one error type of the crate: what went wrong, plus where (file, tensor).

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

/// What went wrong, without the where.
/// New kinds may be added: match with a wildcard arm.
#[derive(Debug)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The operating system refused (open, read, write, rename, map).
    Io(io::Error),
    /// The bytes are not a valid ODTC version-2 checkpoint.
    Malformed(String),
    /// The bytes differ from the checksums the file carries (a flipped bit, a truncation).
    Integrity(String),
    /// A tensor data type code whose element size is unknown (or UNDEFINED).
    UnsupportedDataType(i32),
    /// The state handed to the writer cannot be saved as asked.
    InvalidState(String),
    /// The host stores numbers big-endian; the format is little-endian only.
    BigEndianHost,
    /// The path names a FIFO, socket or device: what it is, e.g. "a FIFO".
    NotRegularFile(&'static str),
    /// A lock stayed held past its deadline, or is another user's: why, and who holds it
    /// as the holder recorded itself (empty when unknown).
    Locked { problem: String, holder: String },
}

/// An error with the file and tensor it concerns, where known.
///
/// Boxed so that `Result<T, Error>` stays one pointer wide on the happy path.
#[derive(Debug)]
pub struct Error(Box<Inner>);

#[derive(Debug)]
struct Inner {
    kind: ErrorKind,
    path: Option<PathBuf>,
    tensor: Option<String>,
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn new(kind: ErrorKind) -> Self {
        Error(Box::new(Inner {
            kind,
            path: None,
            tensor: None,
        }))
    }

    pub fn malformed(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Malformed(message.into()))
    }

    pub fn integrity(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Integrity(message.into()))
    }

    pub fn invalid_state(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidState(message.into()))
    }

    /// Attaches the file path, keeping one already set (the innermost is the most precise).
    pub fn in_file(mut self, path: &Path) -> Self {
        if self.0.path.is_none() {
            self.0.path = Some(path.to_path_buf());
        }
        self
    }

    /// Attaches the tensor name, keeping one already set.
    pub fn in_tensor(mut self, name: &str) -> Self {
        if self.0.tensor.is_none() {
            self.0.tensor = Some(name.to_owned());
        }
        self
    }

    /// Puts the tensor name inside a scope, e.g. a parameter's momentum becomes
    /// `scope/momentum0`; with no tensor yet, the scope itself is the tensor.
    pub fn in_tensor_scope(mut self, scope: &str) -> Self {
        self.0.tensor = Some(match self.0.tensor.take() {
            Some(inner) => format!("{scope}/{inner}"),
            None => scope.to_owned(),
        });
        self
    }

    pub fn kind(&self) -> &ErrorKind {
        &self.0.kind
    }

    pub fn path(&self) -> Option<&Path> {
        self.0.path.as_deref()
    }

    pub fn tensor(&self) -> Option<&str> {
        self.0.tensor.as_deref()
    }

    /// The message without the file prefix (Python puts the file in `filename`).
    pub fn detail(&self) -> String {
        let what = match &self.0.kind {
            ErrorKind::Io(e) => e.to_string(),
            ErrorKind::Malformed(m) | ErrorKind::InvalidState(m) | ErrorKind::Integrity(m) => {
                m.clone()
            }
            ErrorKind::UnsupportedDataType(code) => {
                format!("unsupported tensor data type {code}")
            }
            ErrorKind::Locked { problem, .. } => problem.clone(),
            ErrorKind::NotRegularFile(what) => {
                format!("{what}, not a regular file: refused before reading")
            }
            ErrorKind::BigEndianHost => {
                "this host is big-endian; ONNX Runtime checkpoints are little-endian and \
                 ortckpt does not byte-swap"
                    .to_owned()
            }
        };
        match &self.0.tensor {
            Some(t) => format!("tensor '{t}': {what}"),
            None => what,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0.path {
            Some(p) => write!(f, "{}: {}", p.display(), self.detail()),
            None => f.write_str(&self.detail()),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.0.kind {
            ErrorKind::Io(e) => Some(e),
            _ => None,
        }
    }
}

impl From<io::Error> for Error {
    fn from(e: io::Error) -> Self {
        Error::new(ErrorKind::Io(e))
    }
}
