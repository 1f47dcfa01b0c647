//! The Cloud Hypervisor peer: how `create_ram_region_raw` brings up anonymous guest RAM,
//! reproduced from `DESIGN.md` ("Peers (the anchors)"):
//!
//! - Each region is one plain `mmap`: no address alignment (it takes what the kernel gives,
//!   4 KiB aligned by contract; recent kernels often place large anonymous mappings on a
//!   2 MiB boundary anyway, and the lab records whether they did) and no guard pages.
//! - Prefault with `MADV_POPULATE_WRITE` on even parts, threads = min(16, size / 4 GiB), at
//!   least 1 (in effect one thread per 4 GiB); threads start as they are created.
//! - THP advice (`MADV_HUGEPAGE`) is given *after* prefault, so in THP `madvise` mode the
//!   prefault faults base pages.
//! - Regions are brought up one after another.

use guestmem::sys::{self, MmapRange};

use crate::peer::{advise, len_of, populate_parts, PeerError, PeerMapping, PeerRun, Start};

/// The peer's name in reports.
pub const NAME: &str = "ch-style";

/// Cloud Hypervisor's cap on prefault threads.
pub const MAX_THREADS: usize = 16;

/// Bytes per prefault thread: the divisor in Cloud Hypervisor's thread count.
pub const BYTES_PER_THREAD: u64 = 4 << 30;

/// Threads Cloud Hypervisor uses for a region of `size` bytes (CPUs do not enter into it).
pub fn threads_for(size: u64) -> usize {
    usize::try_from(size / BYTES_PER_THREAD)
        .unwrap_or(usize::MAX)
        .clamp(1, MAX_THREADS)
}

/// An even split of `len` bytes among `threads` in base pages; the last part takes the rest.
pub fn split(len: usize, threads: usize) -> Vec<(usize, usize)> {
    let page = sys::base_page_size() as usize;
    let threads = threads.max(1);
    let per = len / page / threads * page;
    (0..threads)
        .map(|i| {
            let at = i * per;
            let n = if i + 1 == threads { len - at } else { per };
            (at, n)
        })
        .filter(|&(_, n)| n > 0)
        .collect()
}

/// A plain read-write private anonymous mapping of `len` bytes wherever the kernel puts it.
fn map_plain(len: usize) -> Result<PeerMapping, PeerError> {
    // SAFETY: a fresh anonymous mapping at an address the kernel chooses cannot alias any
    // memory this process uses; the result is checked against MAP_FAILED below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(PeerError::Sys {
            peer: NAME,
            op: "mmap",
            addr: 0,
            len,
            source: std::io::Error::last_os_error(),
        });
    }
    // SAFETY: `p..p+len` is the mapping just made, owned by nothing else; the kernel returned
    // it, so the end does not overflow. The PeerMapping becomes its only owner.
    Ok(unsafe { PeerMapping::adopt(MmapRange::new(p as usize, len).expect("kernel range")) })
}

/// Maps, prefaults and then advises each region of `sizes` in turn, as Cloud Hypervisor does.
pub fn bring_up(sizes: &[u64]) -> Result<PeerRun, PeerError> {
    let mut run = PeerRun {
        mappings: Vec::with_capacity(sizes.len()),
        threads: Vec::with_capacity(sizes.len()),
    };
    for &size in sizes {
        let len = len_of(NAME, size)?;
        let m = map_plain(len)?;
        let threads = threads_for(size);
        populate_parts(NAME, &m, &split(len, threads), Start::AsCreated)?;
        advise(
            NAME,
            m.range(),
            libc::MADV_HUGEPAGE,
            "madvise(MADV_HUGEPAGE)",
        )?;
        run.mappings.push(m);
        run.threads.push(threads);
    }
    Ok(run)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_for_is_one_per_4gib_capped() {
        assert_eq!(threads_for(1 << 30), 1);
        assert_eq!(threads_for(4 << 30), 1);
        assert_eq!(threads_for(12 << 30), 3);
        assert_eq!(threads_for(1 << 40), 16);
    }

    #[test]
    fn split_covers_len_exactly() {
        let parts = split(12 << 30, 3);
        assert_eq!(parts.len(), 3);
        assert_eq!(parts.iter().map(|p| p.1).sum::<usize>(), 12 << 30);
    }
}
