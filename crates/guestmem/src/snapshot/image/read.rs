//! Reading a block of an image: the chain's pieces applied oldest first, each read and
//! hashed a piece at a time and checked against its checksum.

use std::fs::File;
use std::os::fd::AsRawFd;

use super::{Image, ImageRegion, Layer, HASH_PIECE};
use crate::snapshot::hash::BlockHasher;
use crate::snapshot::{SnapshotError, IMAGE_PAGE_BYTES};

impl Image {
    /// Reads `block` into `dst` (its length): the chain's pieces applied oldest first, each
    /// checked against its checksum. `scratch` holds an incremental save's block while it is
    /// checked (reused; grown as needed).
    ///
    /// # Safety
    /// `dst..dst+len` (the block's length) must be writable, 8-byte aligned memory that no
    /// one else writes during the call; for a block whose plan does not start with a whole
    /// save, it must read as zero already. For a remote image it is borrowed as a `&mut
    /// [u8]` for the call: no one else may read or write it meanwhile (a buffer of the
    /// caller's own, not guest memory others can reach).
    pub(crate) unsafe fn read_block(
        &self,
        block: u64,
        dst: *mut u8,
        dst_is_zero: bool,
        scratch: &mut Vec<u64>,
    ) -> Result<(), SnapshotError> {
        let (ri, offset, len) = self.block_span(block);
        let region = &self.inner.regions[ri];
        let Some(pieces) = self.plan(block) else {
            if !dst_is_zero {
                // SAFETY: dst..dst+len is writable (the caller's contract).
                unsafe { std::ptr::write_bytes(dst, 0, len as usize) };
            }
            return Ok(());
        };
        let file_offset = region.file_offset + offset;
        let guest_addr = region.guest_addr + offset;
        if let Some(remote) = &self.inner.remote {
            // SAFETY: dst..dst+len is writable and no one else writes it (the caller's
            // contract).
            let dst = unsafe { std::slice::from_raw_parts_mut(dst, len as usize) };
            return remote
                .read(file_offset, dst)
                .map_err(|source| SnapshotError::Remote {
                    region: region.guest_addr,
                    guest_addr,
                    offset: file_offset,
                    from: remote.name(),
                    source,
                });
        }
        for (k, piece) in pieces.iter().enumerate() {
            let layer = &self.inner.layers[piece.layer];
            let whole = piece.pages.is_none();
            if k == 0 && !whole && !dst_is_zero {
                // SAFETY: as above.
                unsafe { std::ptr::write_bytes(dst, 0, len as usize) };
            }
            let target = if whole {
                dst
            } else {
                let words = (len as usize).div_ceil(8);
                if scratch.len() < words {
                    scratch.resize(words, 0);
                }
                scratch.as_mut_ptr() as *mut u8
            };
            // SAFETY: target is dst (the caller's writable block) or scratch, resized to hold
            // len bytes above; both 8-byte aligned.
            let found = unsafe { self.read_hashed(layer, target, len, file_offset, ri, offset)? };
            if self.inner.checked && found != piece.checksum {
                return Err(SnapshotError::Checksum {
                    region: region.guest_addr,
                    guest_addr,
                    path: layer.path.clone(),
                    offset: file_offset,
                    expected: piece.checksum,
                    found,
                });
            }
            if let Some(words) = &piece.pages {
                let page = IMAGE_PAGE_BYTES as usize;
                for p in 0..(len as usize / page) {
                    if words[p / 64] >> (p % 64) & 1 != 0 {
                        // SAFETY: page p lies inside both the scratch copy and dst (len
                        // bytes each), which do not overlap.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                target.add(p * page),
                                dst.add(p * page),
                                page,
                            )
                        };
                    }
                }
            }
        }
        Ok(())
    }
}

impl Image {
    /// Reads `len` bytes of a block (region `ri`, `offset` into it, at `file_offset` of the
    /// layer's file) into `target`, hashing a piece at a time as it goes, so the hash reads
    /// what the copy just left in the cache (one pass over memory fewer than reading the
    /// block, then hashing it). Returns the hash (0 for an unchecked image).
    ///
    /// # Safety
    /// `target..target + len` must be writable, 8-byte aligned memory no one else writes
    /// during the call.
    unsafe fn read_hashed(
        &self,
        layer: &Layer,
        target: *mut u8,
        len: u64,
        file_offset: u64,
        ri: usize,
        offset: u64,
    ) -> Result<u64, SnapshotError> {
        let region = &self.inner.regions[ri];
        let guest_addr = region.guest_addr + offset;
        let mut h = BlockHasher::default();
        let mut at = 0u64;
        while at < len {
            let n = HASH_PIECE.min(len - at);
            // SAFETY: target..target+len is writable (the caller's contract); at + n <= len.
            unsafe {
                let p = target.add(at as usize);
                pread_exact(layer, p, n, file_offset + at, region, guest_addr + at)?;
                // p holds the n bytes just read, 8-byte aligned (target by contract, pieces
                // of whole pages).
                if self.inner.checked {
                    h.update_volatile(p, n as usize);
                }
            }
            at += n;
        }
        Ok(if self.inner.checked { h.finish() } else { 0 })
    }
}

impl Image {
    /// The error for a kernel copy out of [`Image::mapped_block`]'s mapping of `block` that
    /// failed with `source` (`EFAULT`: a page past the file's end, the file having shrunk):
    /// named as a short read of the file would be.
    pub(crate) fn mapped_copy_error(&self, block: u64, source: std::io::Error) -> SnapshotError {
        let (ri, offset, len) = self.block_span(block);
        let region = &self.inner.regions[ri];
        let layer = &self.inner.layers[0];
        let at = region.file_offset + offset;
        match file_len(&layer.file) {
            Ok(file_len) if file_len < at + len => SnapshotError::Truncated {
                region: region.guest_addr,
                guest_addr: region.guest_addr + offset + file_len.saturating_sub(at),
                path: layer.path.clone(),
                offset: file_len.max(at),
                file_len,
            },
            _ => SnapshotError::Io {
                region: region.guest_addr,
                guest_addr: region.guest_addr + offset,
                op: "copy (UFFDIO_COPY) from the mapped",
                path: layer.path.clone(),
                offset: at,
                source,
            },
        }
    }
}

/// Reads `len` bytes at `offset` of the layer's memory file into `dst`.
///
/// # Safety
/// `dst..dst+len` must be writable.
unsafe fn pread_exact(
    layer: &Layer,
    dst: *mut u8,
    len: u64,
    offset: u64,
    region: &ImageRegion,
    guest_addr: u64,
) -> Result<(), SnapshotError> {
    let mut done = 0u64;
    while done < len {
        // SAFETY: dst+done..dst+len is writable (the caller's contract); the kernel writes
        // at most len-done bytes there.
        let n = unsafe {
            libc::pread(
                layer.file.as_raw_fd(),
                dst.add(done as usize) as *mut libc::c_void,
                (len - done) as usize,
                (offset + done) as libc::off_t,
            )
        };
        if n < 0 {
            let source = std::io::Error::last_os_error();
            if source.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(SnapshotError::Io {
                region: region.guest_addr,
                guest_addr: guest_addr + done,
                op: "read",
                path: layer.path.clone(),
                offset: offset + done,
                source,
            });
        }
        if n == 0 {
            return Err(SnapshotError::Truncated {
                region: region.guest_addr,
                guest_addr: guest_addr + done,
                path: layer.path.clone(),
                offset: offset + done,
                file_len: file_len(&layer.file).unwrap_or(offset + done),
            });
        }
        done += n as u64;
    }
    Ok(())
}

/// A file's length; for a block device, its size (seek to the end).
fn file_len(f: &File) -> std::io::Result<u64> {
    let meta = f.metadata()?;
    if meta.is_file() {
        return Ok(meta.len());
    }
    // SAFETY: lseek on a descriptor we own touches no memory.
    let end = unsafe { libc::lseek(f.as_raw_fd(), 0, libc::SEEK_END) };
    if end < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(end as u64)
    }
}
