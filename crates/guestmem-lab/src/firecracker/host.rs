//! The host state a Firecracker round is measured in: a memory file's page cache (read in,
//! dropped, and what of it is cached, from `mincore`), and the 2 MiB hugetlb pool a huge-page
//! guest needs, reserved for the scenario and always given back.

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::path::Path;

/// The 2 MiB pool's folder in sysfs (the pool `/proc/sys/vm/nr_hugepages` sizes where 2 MiB
/// is the default huge page size, named explicitly here).
const POOL_2M: &str = "/sys/kernel/mm/hugepages/hugepages-2048kB";

/// Reads `path` whole once, so that it is in the page cache.
pub fn warm(path: &Path) -> io::Result<()> {
    let mut f = File::open(path)?;
    let mut buf = vec![0u8; 1 << 20];
    while f.read(&mut buf)? > 0 {}
    Ok(())
}

/// Drops `path` from the page cache: written back first (a page still dirty is not
/// dropped), then `POSIX_FADV_DONTNEED` over the whole file. Pages some process still maps
/// stay; a round's VMs are gone before the next round's cache is prepared.
pub fn drop_cache(path: &Path) -> io::Result<()> {
    let f = File::open(path)?;
    f.sync_all()?;
    // SAFETY: advice on our own open descriptor; no memory is touched.
    let r = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    match r {
        0 => Ok(()),
        e => Err(io::Error::from_raw_os_error(e)),
    }
}

/// The share of `path`'s pages in the page cache (0 to 1)
/// ([`guestmem::inspect::page_cache_share`]).
pub fn cached_share(path: &Path) -> io::Result<f64> {
    guestmem::inspect::page_cache_share(&File::open(path)?)
}

/// A value of the 2 MiB pool's sysfs file `file`.
fn pool_value(file: &str) -> io::Result<u64> {
    let p = format!("{POOL_2M}/{file}");
    std::fs::read_to_string(&p)?
        .trim()
        .parse()
        .map_err(|e| io::Error::other(format!("{p}: {e}")))
}

/// The 2 MiB hugetlb pool grown by some pages; dropping it puts `nr_hugepages` back to what
/// it was (on errors and panics too).
#[derive(Debug)]
pub struct HugePool {
    old: u64,
}

impl HugePool {
    /// Grows the pool by `pages` and checks that as many are free and unreserved; why not,
    /// when it cannot (not root, no such pool, no memory the kernel could find).
    pub fn reserve(pages: u64) -> Result<HugePool, String> {
        let old = pool_value("nr_hugepages").map_err(|e| format!("no 2 MiB pool: {e}"))?;
        std::fs::write(format!("{POOL_2M}/nr_hugepages"), (old + pages).to_string())
            .map_err(|e| format!("cannot grow the 2 MiB hugetlb pool ({e}); needs root"))?;
        // Written: from here the guard puts it back, whatever follows.
        let pool = HugePool { old };
        let free = pool_value("free_hugepages")
            .and_then(|f| Ok(f.saturating_sub(pool_value("resv_hugepages")?)))
            .map_err(|e| e.to_string())?;
        if free < pages {
            return Err(format!(
                "asked the 2 MiB hugetlb pool for {pages} pages, {free} are free"
            ));
        }
        Ok(pool)
    }
}

impl Drop for HugePool {
    fn drop(&mut self) {
        let p = format!("{POOL_2M}/nr_hugepages");
        if let Err(e) = std::fs::write(&p, self.old.to_string()) {
            eprintln!("could not put {p} back to {}: {e}", self.old);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dropped_file_is_not_cached_and_a_read_one_is() {
        let p = std::env::temp_dir().join(format!("guestmem-cache-{}", std::process::id()));
        std::fs::write(&p, vec![7u8; 4 << 20]).unwrap();
        warm(&p).unwrap();
        assert!(cached_share(&p).unwrap() > 0.99);
        drop_cache(&p).unwrap();
        // tmpfs has no backing store to drop its pages to.
        let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
        // SAFETY: an all-zero statfs is valid; statfs writes one for a NUL-terminated path.
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: `c` is NUL-terminated, `st` a live statfs.
        assert_eq!(unsafe { libc::statfs(c.as_ptr(), &mut st) }, 0);
        if st.f_type != libc::TMPFS_MAGIC {
            let share = cached_share(&p).unwrap();
            assert!(share < 0.01, "{share} still cached after drop_cache");
        }
        std::fs::remove_file(&p).unwrap();
    }
}
