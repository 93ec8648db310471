//! The bytes of a model file: mapped read-only from disk, or held in memory (a file built
//! or received by the caller, as the fuzz targets do).

use std::ops::Deref;

use memmap2::Mmap;

pub enum FileBytes {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl Deref for FileBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            FileBytes::Mapped(m) => m,
            FileBytes::Owned(v) => v,
        }
    }
}
