//! A segment's records on disk: each a 64-byte header (its frame's length, its BLAKE3
//! hash, its checksum sealed with the hash), then the frame, the next at a multiple of 64.

use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use crate::snapshot::IMAGE_PAGE_BYTES;
use crate::store::manifest::MAX_FRAME_BYTES;

/// A record's header: [`MAGIC`], the frame's length, its BLAKE3 hash, its checksum sealed
/// with the hash ([`sealed`]), 8 zero bytes ([`DROPPED`] once its record was found bad).
pub(super) const HEADER: usize = 64;
pub(super) const MAGIC: [u8; 8] = *b"GMCSEG01";
/// Written over a header's last 8 bytes when its record was found bad: skipped by later
/// scans (the only write to a record after it was appended).
pub(super) const DROPPED: [u8; 8] = *b"dropped!";
/// Records start at multiples of this.
pub(super) const ALIGN: u64 = 64;

/// What a record of a `len`-byte frame takes in its segment.
pub(super) fn record_bytes(len: u64) -> u64 {
    (HEADER as u64 + len).next_multiple_of(ALIGN)
}

pub(super) fn header(h: &[u8; 32], plain: &[u8]) -> [u8; HEADER] {
    let mut t = [0u8; HEADER];
    t[..8].copy_from_slice(&MAGIC);
    t[8..16].copy_from_slice(&(plain.len() as u64).to_le_bytes());
    t[16..48].copy_from_slice(h);
    t[48..56].copy_from_slice(&sealed(h, checksum(plain)).to_le_bytes());
    t
}

/// A header's frame length and hash, and whether its record was dropped, if it is one.
pub(super) fn parse_header(t: &[u8; HEADER]) -> Option<(u64, [u8; 32], bool)> {
    let len = u64::from_le_bytes(t[8..16].try_into().expect("8 bytes"));
    let dropped = t[56..] == DROPPED;
    (t[..8] == MAGIC && frame_len_ok(len) && (dropped || t[56..] == [0u8; 8]))
        .then(|| (len, t[16..48].try_into().expect("32 bytes"), dropped))
}

/// Whether a frame of `len` bytes can be a record's: a whole number of pages (every frame
/// and diff piece is), none past [`MAX_FRAME_BYTES`]. A header naming another length is
/// not one (an empty record would let 1 MiB of file stand for 16,384 index entries).
pub(super) fn frame_len_ok(len: u64) -> bool {
    len > 0 && len <= MAX_FRAME_BYTES && len.is_multiple_of(IMAGE_PAGE_BYTES)
}

/// A frame's checksum folded with the first 8 bytes of its hash, so that a record passes
/// the check only under the name it was written for.
pub(super) fn sealed(h: &[u8; 32], sum: u64) -> u64 {
    sum ^ u64::from_le_bytes(h[..8].try_into().expect("8 bytes"))
}

/// The checksum a record carries: guestmem's block checksum (`snapshot/hash.rs`, the check
/// local snapshot images carry), a pass at memory speed. (CRC-64 through crc-fast measured
/// the same here, and overflows a 256 KiB worker stack in a debug build.)
pub(super) fn checksum(plain: &[u8]) -> u64 {
    let mut h = crate::snapshot::BlockHasher::default();
    h.update(plain);
    h.finish()
}

/// A record found by a scan: its frame's hash, its header's offset, the frame's length.
pub(super) type Record = ([u8; 32], u64, u64);

/// The records of a segment from the one at `from` whose headers are whole, in order, but
/// those dropped: (hash, header offset, frame length). It stops at the first that is not
/// whole (a write a crash cut short, or one another process has not finished). With how
/// many headers it read, dropped ones included, and where it stopped (a segment another
/// process appends to is scanned on from there).
pub(super) fn scan_from(file: &File, from: u64, file_len: u64) -> (Vec<Record>, usize, u64) {
    let (mut out, mut headers) = (Vec::new(), 0);
    let mut off = from;
    let mut t = [0u8; HEADER];
    while off + HEADER as u64 <= file_len {
        if file.read_exact_at(&mut t, off).is_err() {
            break;
        }
        let Some((len, h, dropped)) = parse_header(&t) else {
            break;
        };
        if off + HEADER as u64 + len > file_len {
            break;
        }
        headers += 1;
        if !dropped {
            out.push((h, off, len));
        }
        off += record_bytes(len);
    }
    (out, headers, off)
}

/// A segment made earlier, opened to be read (and written only to mark a record found bad).
pub(super) fn open_segment(path: &Path) -> std::io::Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
}
