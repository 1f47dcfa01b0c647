//! The regions of a handshake: the JSON array Firecracker sends, parsed and checked region
//! by region (page size, alignment, bounds) and against each other (no overlap in the peer's
//! address space or in the memory file).

use super::{HandshakeError, ServeError};
use crate::layout::MAX_REGIONS;

/// Firecracker's small page: its anonymous memory's.
pub const SMALL_PAGE_BYTES: u64 = 4 << 10;
/// Firecracker's huge page: its 2 MiB hugetlbfs memory's.
pub const HUGE_PAGE_BYTES: u64 = 2 << 20;
/// Page sizes Firecracker's memory uses.
pub const PAGE_SIZES: [u64; 2] = [SMALL_PAGE_BYTES, HUGE_PAGE_BYTES];
/// The highest user-space address on x86_64 with 5-level paging.
const USER_ADDR_END: u64 = 1 << 56;

/// One region of the peer's memory, as its handshake declared it and it was checked.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct UffdRegion {
    /// Where the region starts in the peer's address space.
    pub base_host_virt_addr: u64,
    /// Bytes.
    pub size: u64,
    /// Where its bytes start in the memory file.
    pub offset: u64,
    /// Its page size, bytes.
    pub page_size: u64,
}

/// A region as the JSON has it (unknown fields, such as a fork's `gpa_start`, are let be).
#[derive(serde::Deserialize)]
struct WireRegion {
    base_host_virt_addr: u64,
    size: u64,
    offset: u64,
    #[serde(default)]
    page_size: Option<u64>,
    #[serde(default)]
    page_size_kib: Option<u64>,
}

/// Parses and checks the JSON of a handshake: see the `serve` module's docs for what is
/// refused.
pub fn parse_regions(json: &[u8]) -> Result<Vec<UffdRegion>, ServeError> {
    let wire: Vec<WireRegion> =
        serde_json::from_slice(json).map_err(|e| HandshakeError::NotRegions {
            reason: e.to_string(),
            bytes: json.len(),
        })?;
    if wire.is_empty() {
        return Err(HandshakeError::NoRegions.into());
    }
    if wire.len() > MAX_REGIONS {
        return Err(HandshakeError::TooManyRegions(wire.len()).into());
    }
    let out = wire
        .iter()
        .enumerate()
        .map(|(i, w)| check_region(i, w))
        .collect::<Result<Vec<_>, _>>()?;
    apart(&out, |r| r.base_host_virt_addr, "peer's address space")?;
    apart(&out, |r| r.offset, "memory file")?;
    Ok(out)
}

/// The page size a region declares: `page_size`, or `page_size_kib` (KiB in Firecracker
/// 1.7-1.10, bytes since: the page sizes in KiB, 4 and 2048, and in bytes, 4096 and 2 MiB,
/// do not collide), or 4 KiB when it declares neither (the oldest releases).
fn page_size_of(
    w: &WireRegion,
    bad: &dyn Fn(&'static str, String) -> HandshakeError,
) -> Result<u64, HandshakeError> {
    // `page_size` is the field Firecracker means: checked first.
    if let Some(p) = w.page_size.filter(|p| !PAGE_SIZES.contains(p)) {
        return Err(bad(
            "page_size",
            format!("page_size {p}: page size {p}; Firecracker's memory has 4 KiB or 2 MiB pages"),
        ));
    }
    let kib = match w.page_size_kib {
        None => None,
        // In KiB (Firecracker 1.7-1.10), or in bytes (later releases).
        Some(4) | Some(SMALL_PAGE_BYTES) => Some(SMALL_PAGE_BYTES),
        Some(2048) | Some(HUGE_PAGE_BYTES) => Some(HUGE_PAGE_BYTES),
        Some(v) => {
            return Err(bad(
                "page_size_kib",
                format!("page_size_kib {v} is no page size"),
            ))
        }
    };
    let page = match (w.page_size, kib) {
        (Some(p), Some(k)) if p != k => {
            return Err(bad(
                "page_size",
                format!("page_size {p} and page_size_kib {k} disagree"),
            ))
        }
        (Some(p), _) => p,
        (None, Some(k)) => k,
        (None, None) => SMALL_PAGE_BYTES,
    };
    if !PAGE_SIZES.contains(&page) {
        let field = if w.page_size.is_some() {
            "page_size"
        } else {
            "page_size_kib"
        };
        return Err(bad(
            field,
            format!(
                "{field} {page}: page size {page}; Firecracker's memory has 4 KiB or 2 MiB pages"
            ),
        ));
    }
    Ok(page)
}

/// One region, checked on its own: aligned, non-empty, inside user address space, its file
/// range without overflow.
fn check_region(index: usize, w: &WireRegion) -> Result<UffdRegion, HandshakeError> {
    let host = w.base_host_virt_addr;
    let bad = |field: &'static str, reason: String| HandshakeError::Region {
        index,
        host,
        field,
        reason,
    };
    let page = page_size_of(w, &bad)?;
    if !host.is_multiple_of(page) {
        return Err(bad(
            "base_host_virt_addr",
            format!("base_host_virt_addr not at a {page}-byte page boundary"),
        ));
    }
    if w.size == 0 || !w.size.is_multiple_of(page) {
        return Err(bad(
            "size",
            format!(
                "size {:#x} is not a non-zero number of {page}-byte pages",
                w.size
            ),
        ));
    }
    if host.checked_add(w.size).is_none_or(|e| e > USER_ADDR_END) {
        return Err(bad(
            "size",
            format!("size {:#x} runs past the end of user address space", w.size),
        ));
    }
    if !w.offset.is_multiple_of(page) {
        return Err(bad(
            "offset",
            format!(
                "file offset {:#x} is not a multiple of its page size {page}",
                w.offset
            ),
        ));
    }
    if w.offset.checked_add(w.size).is_none() {
        return Err(bad(
            "offset",
            format!(
                "file offset {:#x} + size {:#x} overflows 64 bits",
                w.offset, w.size
            ),
        ));
    }
    Ok(UffdRegion {
        base_host_virt_addr: host,
        size: w.size,
        offset: w.offset,
        page_size: page,
    })
}

/// Checks no two regions overlap by `key` (their start in the peer's address space, or in
/// the memory file), naming `space`.
fn apart(
    out: &[UffdRegion],
    key: fn(&UffdRegion) -> u64,
    space: &'static str,
) -> Result<(), HandshakeError> {
    let mut idx: Vec<usize> = (0..out.len()).collect();
    idx.sort_unstable_by_key(|&i| key(&out[i]));
    for w in idx.windows(2) {
        let (a, b) = (&out[w[0]], &out[w[1]]);
        if key(a) + a.size > key(b) {
            return Err(HandshakeError::Overlap {
                a: w[0],
                b: w[1],
                space,
                a_start: key(a),
                a_size: a.size,
                b_start: key(b),
                b_size: b.size,
            });
        }
    }
    Ok(())
}
