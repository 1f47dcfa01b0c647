//! The Cloud Hypervisor peer: how `create_ram_region_raw` brings up anonymous guest RAM,
//! reproduced from Cloud Hypervisor's `vmm/src/memory_manager.rs` as it reads today:
//!
//! - Each region is one plain `mmap`: no address alignment (it takes what the kernel gives,
//!   4 KiB aligned by contract; recent kernels often place large anonymous mappings on a
//!   2 MiB boundary anyway, and the lab records whether they did) and no guard pages.
//! - Prefault with `MADV_POPULATE_WRITE` on even parts, threads = min(16, size / 4 GiB), at
//!   least 1 (in effect one thread per 4 GiB); threads start as they are created.
//! - THP advice (`MADV_HUGEPAGE`) is given *after* prefault, so in THP `madvise` mode the
//!   prefault faults base pages.
//! - Regions are brought up one after another.

use guestmem::mmap::{Advice, Mapping};
use guestmem::workers::Start;

use crate::peer::{advise, len_of, mmap_err, populate_parts, PeerError, PeerRun};

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
    let page = guestmem::base_page_size() as usize;
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
fn map_plain(len: usize) -> Result<Mapping, PeerError> {
    Mapping::anonymous(len).map_err(mmap_err(NAME))
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
        advise(NAME, &m, Advice::HugePage)?;
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
