//! Reading what a push reads, a frame at a time: a raw memory file (past its end reads as
//! zero), a guestmem image (every block checked); a guestmem image's regions and working set
//! as the store keeps them; a diff's pages packed; zero frames found.

use std::collections::HashSet;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::StoreError;
use crate::snapshot::{Image, ManifestRegion, IMAGE_PAGE_BYTES};

pub(super) fn check_len(len: u64, path: &Path) -> Result<(), StoreError> {
    if len == 0 || !len.is_multiple_of(IMAGE_PAGE_BYTES) || len > super::manifest::MAX_MEMORY_BYTES
    {
        return Err(StoreError::Io {
            op: "push (its length must be a non-zero multiple of 4 KiB, at most 16 TiB)",
            path: path.to_path_buf(),
            source: std::io::Error::from_raw_os_error(libc::EINVAL),
        });
    }
    Ok(())
}

/// A guestmem image's regions as the store keeps them (where each lies in its memory).
pub(super) fn image_regions(image: &Image) -> Vec<ManifestRegion> {
    image
        .regions()
        .iter()
        .map(|r| ManifestRegion {
            guest_addr: r.guest_addr,
            size: r.size,
            file_offset: r.file_offset,
            page_size: r.page_size,
            backing: r.backing.clone(),
            huge_bytes: r.huge_bytes,
        })
        .collect()
}

/// A guestmem image's working set (blocks) as frames, first first.
pub(super) fn working_frames(image: &Image, frame_bytes: u64) -> Vec<u64> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for &b in image.working_set() {
        if b >= image.total_blocks() {
            continue;
        }
        let (ri, off, len) = image.block_span(b);
        let at = image.regions()[ri].file_offset + off;
        for f in at / frame_bytes..(at + len).div_ceil(frame_bytes) {
            if seen.insert(f) {
                out.push(f);
            }
        }
    }
    out
}

/// The pages of `bytes` that `mask` names, packed in page order.
pub(super) fn pack(bytes: &[u8], mask: &[u64]) -> Vec<u8> {
    let page = IMAGE_PAGE_BYTES as usize;
    let mut out = Vec::new();
    for p in 0..bytes.len() / page {
        if mask[p / 64] >> (p % 64) & 1 != 0 {
            out.extend_from_slice(&bytes[p * page..(p + 1) * page]);
        }
    }
    out
}

pub(super) fn is_zero(b: &[u8]) -> bool {
    let (pre, words, post) = {
        // SAFETY: any byte pattern is a valid u64; align_to splits at the aligned middle.
        unsafe { b.align_to::<u64>() }
    };
    pre.iter().all(|&x| x == 0) && words.iter().all(|&x| x == 0) && post.iter().all(|&x| x == 0)
}

/// Reads `dst.len()` bytes at `offset` of a raw memory file; past its end reads as zero.
pub(super) fn read_file(
    file: &File,
    len: u64,
    offset: u64,
    dst: &mut [u8],
) -> Result<(), StoreError> {
    let n = (len.saturating_sub(offset)).min(dst.len() as u64) as usize;
    file.read_exact_at(&mut dst[..n], offset)
        .map_err(|source| {
            // Named by the path it was opened at, as the kernel knows it (an error only).
            let fd = PathBuf::from(format!(
                "/proc/self/fd/{}",
                std::os::fd::AsRawFd::as_raw_fd(file)
            ));
            StoreError::Io {
                op: "read the memory file at its frames",
                path: std::fs::read_link(&fd).unwrap_or(fd),
                source,
            }
        })?;
    dst[n..].fill(0);
    Ok(())
}

/// The runs (file offset, bytes) of the pages of the frame at `offset` that `mask` names, in
/// page order: where a diff's packed piece lies in its file.
pub(super) fn mask_runs(offset: u64, mask: &[u64], pages: u64) -> Vec<(u64, u64)> {
    let page = IMAGE_PAGE_BYTES;
    let bit = |p: u64| mask[(p / 64) as usize] >> (p % 64) & 1 != 0;
    let mut runs = Vec::new();
    let mut p = 0;
    while p < pages {
        if !bit(p) {
            p += 1;
            continue;
        }
        let run_start = p;
        while p < pages && bit(p) {
            p += 1;
        }
        runs.push((offset + run_start * page, (p - run_start) * page));
    }
    runs
}

/// The bytes of `runs` of a raw memory file, read straight into place one after another,
/// appended to `out` (past the file's end reads as zero).
pub(super) fn read_runs(
    file: &File,
    len: u64,
    runs: &[(u64, u64)],
    out: &mut Vec<u8>,
) -> Result<(), StoreError> {
    for &(at, n) in runs {
        let from = out.len();
        out.resize(from + n as usize, 0);
        read_file(file, len, at, &mut out[from..])?;
    }
    Ok(())
}

/// Reads `dst.len()` bytes at `offset` of a guestmem image's memory (regions where their
/// `file_offset` says), every block checked; bytes no region holds read as zero.
pub(super) fn read_image(
    image: &Image,
    regions: &[ManifestRegion],
    offset: u64,
    dst: &mut [u8],
) -> Result<(), StoreError> {
    dst.fill(0);
    let end = offset + dst.len() as u64;
    let bb = image.block_bytes();
    let mut scratch = Vec::new();
    let mut block: Vec<u64> = Vec::new();
    for (ri, r) in regions.iter().enumerate() {
        let (s, e) = (offset.max(r.file_offset), end.min(r.file_offset + r.size));
        let mut at = s;
        while at < e {
            let in_region = at - r.file_offset;
            let b = image.regions()[ri].first_block + in_region / bb;
            let (_, boff, blen) = image.block_span(b);
            if block.len() < (blen as usize).div_ceil(8) {
                block.resize((blen as usize).div_ceil(8), 0);
            }
            // SAFETY: `block` is this thread's own, 8-byte aligned, at least blen bytes.
            unsafe { image.read_block(b, block.as_mut_ptr() as *mut u8, false, &mut scratch)? };
            // SAFETY: as above; just written.
            let bbytes =
                unsafe { std::slice::from_raw_parts(block.as_ptr() as *const u8, blen as usize) };
            let from = (in_region - boff) as usize;
            let n = ((e - at) as usize).min(blen as usize - from);
            let d = (at - offset) as usize;
            dst[d..d + n].copy_from_slice(&bbytes[from..from + n]);
            at += n as u64;
        }
    }
    Ok(())
}
