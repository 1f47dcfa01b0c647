//! The host state a Firecracker round is measured in: a memory file's page cache (read in,
//! dropped, and what of it is cached, from `mincore`). The 2 MiB hugetlb pool a huge-page
//! guest needs is reserved with the test kit's guard (`guestmem_testkit::HugePool2M`), which
//! always gives it back.

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::path::Path;

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
