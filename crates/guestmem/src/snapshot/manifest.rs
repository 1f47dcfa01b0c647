//! Reading and checking `manifest.json`: everything a manifest claims about the layout and
//! the blocks is checked here, before any memory file is read.

use std::path::Path;

use super::{
    Manifest, ManifestRegion, SnapshotError, FORMAT, IMAGE_PAGE_BYTES, MANIFEST_FILE,
    MAX_PAGE_BLOCK_BYTES, MAX_STAGED_BLOCK_BYTES, VERSION,
};
use crate::files::Dir;

/// Most blocks an image may have (64 TiB of 1 MiB blocks).
pub const MAX_BLOCKS: u64 = 1 << 26;
/// Largest `manifest.json` read: a manifest is read into memory whole and parsed (page lists
/// grow up to ~8x from text to words), so this bounds what a file can make a reader allocate
/// (~0.5 GiB at worst). 64 MiB holds the block records of ~600 GiB of data in 1 MiB blocks.
pub const MAX_MANIFEST_BYTES: u64 = 64 << 20;
/// Longest save id read (guestmem writes 16 hex digits).
const MAX_ID_CHARS: usize = 64;

/// Reads and checks the manifest of the snapshot directory `dir`.
pub(crate) fn read_manifest(dir: &Dir) -> Result<Manifest, SnapshotError> {
    let text = dir
        .read_capped(MANIFEST_FILE, MAX_MANIFEST_BYTES)
        .map_err(SnapshotError::from)?;
    parse_manifest(&text, &dir.join(MANIFEST_FILE))
}

/// Parses and checks a manifest's text; `path` names it in errors. Every field is bounded
/// and checked against the others; the memory file's length is checked by the opener.
pub(crate) fn parse_manifest(text: &[u8], path: &Path) -> Result<Manifest, SnapshotError> {
    let bad = |reason: String| SnapshotError::Manifest {
        path: path.to_path_buf(),
        reason,
    };
    let m: Manifest = serde_json::from_slice(text).map_err(|e| bad(e.to_string()))?;
    check_header(&m).map_err(bad)?;
    let memory_bytes = check_regions(&m).map_err(bad)?;
    check_sizes(&m, memory_bytes).map_err(bad)?;
    check_blocks(&m).map_err(bad)?;
    check_references(&m).map_err(bad)?;
    Ok(m)
}

/// Whether `s` is 1 to [`MAX_ID_CHARS`] hex digits (an id), or exactly `len` of them.
fn hex(s: &str, len: Option<usize>) -> bool {
    let n = s.len();
    len.map_or(n > 0 && n <= MAX_ID_CHARS, |l| n == l) && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Format, version, block size, id.
fn check_header(m: &Manifest) -> Result<(), String> {
    if m.format != FORMAT {
        return Err(format!("format {:?}, not {FORMAT:?}", m.format));
    }
    if m.version != VERSION {
        return Err(format!("version {}, this build reads {VERSION}", m.version));
    }
    if !m.block_bytes.is_power_of_two()
        || !(IMAGE_PAGE_BYTES..=MAX_PAGE_BLOCK_BYTES).contains(&m.block_bytes)
    {
        return Err(format!(
            "block size {:#x} is not a power of two from 4 KiB to {MAX_PAGE_BLOCK_BYTES:#x}",
            m.block_bytes
        ));
    }
    if !hex(&m.id, None) {
        return Err(format!(
            "id {:?} is not 1 to {MAX_ID_CHARS} hex digits",
            m.id
        ));
    }
    Ok(())
}

/// The regions: in order, aligned, apart, laid end to end in the file, pages that fit a
/// block. Returns the bytes they hold.
fn check_regions(m: &Manifest) -> Result<u64, String> {
    if m.regions.is_empty() {
        return Err("no region".into());
    }
    let mut offset = 0u64;
    let mut prev_end = 0u64;
    for (i, r) in m.regions.iter().enumerate() {
        let end = r.guest_addr.checked_add(r.size);
        if r.size == 0
            || !r.size.is_multiple_of(IMAGE_PAGE_BYTES)
            || !r.guest_addr.is_multiple_of(IMAGE_PAGE_BYTES)
            || end.is_none()
            || (i > 0 && r.guest_addr < prev_end)
        {
            return Err(format!(
                "region {i} at {:#x} size {:#x}: empty, unaligned, overflowing or overlapping",
                r.guest_addr, r.size
            ));
        }
        if r.file_offset != offset {
            return Err(format!(
                "region {i} at {:#x}: file offset {:#x}, the regions before it end at {offset:#x}",
                r.guest_addr, r.file_offset
            ));
        }
        if !r.page_size.is_power_of_two()
            || r.page_size < IMAGE_PAGE_BYTES
            || r.page_size > m.block_bytes
            || !r.size.is_multiple_of(r.page_size)
        {
            return Err(format!(
                "region {i} at {:#x}: page size {:#x} does not fit the block size {:#x}",
                r.guest_addr, r.page_size, m.block_bytes
            ));
        }
        if r.huge_bytes > r.size {
            return Err(format!(
                "region {i} at {:#x}: huge_bytes {:#x} is more than its size {:#x}",
                r.guest_addr, r.huge_bytes, r.size
            ));
        }
        offset = offset.checked_add(r.size).ok_or("sizes overflow")?;
        prev_end = end.unwrap_or(u64::MAX);
    }
    Ok(offset)
}

/// The block size against the pages (what a restoring thread stages), the memory size
/// against the regions, the block count against its cap.
fn check_sizes(m: &Manifest, memory_bytes: u64) -> Result<(), String> {
    let largest_page = m.regions.iter().map(|r| r.page_size).max().unwrap_or(0);
    if m.block_bytes > MAX_STAGED_BLOCK_BYTES.max(largest_page) {
        return Err(format!(
            "block size {:#x}: at most {MAX_STAGED_BLOCK_BYTES:#x} (each restoring thread \
             stages a block), or the largest page size {largest_page:#x}",
            m.block_bytes
        ));
    }
    if m.memory_bytes != memory_bytes {
        return Err(format!(
            "memory_bytes {:#x}, the regions hold {memory_bytes:#x}",
            m.memory_bytes
        ));
    }
    let total = m.total_blocks();
    if total > MAX_BLOCKS {
        return Err(format!(
            "{total} blocks, more than {MAX_BLOCKS}: use larger blocks"
        ));
    }
    Ok(())
}

/// The block records: in range, in order, 16-hex-digit checksums, page lists a block long.
fn check_blocks(m: &Manifest) -> Result<(), String> {
    let total = m.total_blocks();
    let words = (m.block_bytes / IMAGE_PAGE_BYTES).div_ceil(64) as usize;
    let mut last = None;
    for b in &m.blocks {
        if b.index >= total || last.is_some_and(|l| l >= b.index) {
            return Err(format!(
                "block {}: out of range (of {total}) or out of order",
                b.index
            ));
        }
        last = Some(b.index);
        if !hex(&b.checksum, Some(16)) {
            return Err(format!(
                "block {}: checksum {:?} is not 16 hex digits",
                b.index, b.checksum
            ));
        }
        if b.pages.as_ref().is_some_and(|p| p.len() != words) {
            return Err(format!("block {}: page list of the wrong length", b.index));
        }
    }
    Ok(())
}

/// What the manifest names: working-set blocks, the parent, the memory file.
fn check_references(m: &Manifest) -> Result<(), String> {
    let total = m.total_blocks();
    if let Some(w) = m.working_set.iter().find(|&&w| w >= total) {
        return Err(format!("working set names block {w}, of {total}"));
    }
    if let Some(p) = &m.parent {
        if !hex(&p.id, None) {
            return Err(format!("parent id {:?} is not hex digits", p.id));
        }
        if p.dir.as_os_str().is_empty() {
            return Err("parent directory is empty".into());
        }
    }
    if m.memory_file.contains('/') || m.memory_file.is_empty() {
        return Err(format!(
            "memory file {:?} must be a plain name",
            m.memory_file
        ));
    }
    Ok(())
}

/// Checks two layouts agree region by region (address and size).
pub(crate) fn same_layout(
    a: &[ManifestRegion],
    b: &[ManifestRegion],
    a_name: &'static str,
    b_name: &'static str,
) -> Result<(), SnapshotError> {
    for i in 0..a.len().max(b.len()) {
        match (a.get(i), b.get(i)) {
            (Some(x), Some(y)) if x.guest_addr == y.guest_addr && x.size == y.size => {}
            (x, y) => {
                let pair = |r: Option<&ManifestRegion>| r.map(|r| (r.guest_addr, r.size));
                return Err(SnapshotError::Layout {
                    index: i,
                    a_name,
                    a: pair(x),
                    b_name,
                    b: pair(y),
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn good() -> serde_json::Value {
        serde_json::json!({
            "format": FORMAT, "version": VERSION, "id": "00ff", "memory_file": "memory",
            "memory_bytes": 3 << 20, "block_bytes": 1 << 20,
            "regions": [
                {"guest_addr": 0, "size": 2 << 20, "file_offset": 0, "page_size": 4096, "backing": "anonymous"},
                {"guest_addr": 4 << 20, "size": 1 << 20, "file_offset": 2 << 20, "page_size": 4096, "backing": "memfd"}
            ],
            "blocks": [{"index": 0, "checksum": "0123456789abcdef"},
                       {"index": 2, "checksum": "0000000000000001", "pages": [1, 2, 3, 4]}],
            "working_set": [2, 1]
        })
    }

    fn parse(v: &serde_json::Value) -> Result<Manifest, String> {
        parse_manifest(&serde_json::to_vec(v).unwrap(), Path::new("m.json"))
            .map_err(|e| e.to_string())
    }

    #[test]
    fn a_manifest_guestmem_writes_parses_with_its_block_arithmetic() {
        let m = parse(&good()).unwrap();
        assert_eq!(m.total_blocks(), 3);
        assert_eq!(m.region_blocks(&m.regions[0]), 2);
        assert_eq!(m.working_set, [2, 1]);
    }

    #[test]
    fn each_bad_field_is_refused_naming_it() {
        type Edit = fn(&mut serde_json::Value);
        let cases: [(Edit, &str); 15] = [
            (|v| v["format"] = "other".into(), "format \"other\""),
            (|v| v["version"] = 2.into(), "version 2"),
            (|v| v["id"] = "xyz".into(), "id \"xyz\""),
            (|v| v["block_bytes"] = 3000.into(), "block size 0xbb8"),
            (
                |v| v["block_bytes"] = (1u64 << 31).into(),
                "block size 0x80000000",
            ),
            (|v| v["regions"] = serde_json::json!([]), "no region"),
            (
                |v| v["regions"][1]["guest_addr"] = (1u64 << 20).into(),
                "overlapping",
            ),
            (
                |v| v["regions"][1]["file_offset"] = 0.into(),
                "file offset 0x0",
            ),
            (
                |v| v["regions"][0]["page_size"] = 512.into(),
                "page size 0x200",
            ),
            (|v| v["memory_bytes"] = 1.into(), "memory_bytes 0x1"),
            (
                |v| v["blocks"][1]["index"] = 3.into(),
                "block 3: out of range",
            ),
            (
                |v| v["blocks"][1]["checksum"] = "12".into(),
                "not 16 hex digits",
            ),
            (
                |v| v["blocks"][1]["pages"] = serde_json::json!([1]),
                "page list of the wrong length",
            ),
            (
                |v| v["working_set"] = serde_json::json!([9]),
                "working set names block 9",
            ),
            (|v| v["memory_file"] = "../x".into(), "must be a plain name"),
        ];
        for (edit, says) in cases {
            let mut v = good();
            edit(&mut v);
            let e = parse(&v).unwrap_err();
            assert!(e.contains(says), "{says}: {e}");
            assert!(e.contains("m.json"), "names the file: {e}");
        }
    }

    #[test]
    fn large_blocks_need_large_pages() {
        let mut v = good();
        v["block_bytes"] = (128u64 << 20).into();
        v["regions"] = serde_json::json!([{"guest_addr": 0, "size": 128u64 << 20, "file_offset": 0,
            "page_size": 4096, "backing": "anonymous"}]);
        v["memory_bytes"] = (128u64 << 20).into();
        v["blocks"] = serde_json::json!([]);
        v["working_set"] = serde_json::json!([]);
        assert!(parse(&v).unwrap_err().contains("at most 0x4000000"));
        // 1 GiB hugetlb pages: 1 GiB blocks are the page itself.
        v["block_bytes"] = (1u64 << 30).into();
        v["regions"][0]["size"] = (1u64 << 30).into();
        v["regions"][0]["page_size"] = (1u64 << 30).into();
        v["memory_bytes"] = (1u64 << 30).into();
        parse(&v).unwrap();
    }

    #[test]
    fn unknown_fields_are_refused() {
        let mut v = good();
        v["extra"] = 1.into();
        assert!(parse(&v).unwrap_err().contains("unknown field"));
    }
}
