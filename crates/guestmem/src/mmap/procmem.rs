//! This process's own memory read and touched through `/proc/self`: which pages of a
//! mapping were ever faulted in (`pagemap`), and a touch that cannot raise `SIGBUS`
//! (`mem`). It names ranges of a [`Mapping`], so it lives with the owners, checked like
//! every other range call.

use std::io;

use super::Mapping;

/// This process's memory as a file (`/proc/self/mem`), for touching pages without risking a
/// `SIGBUS`.
///
/// An access through this file is made by the kernel on the process's behalf (`access_remote_vm`):
/// a fault that would raise `SIGBUS` on a CPU access (a hugetlb pool run dry under
/// `MAP_NORESERVE`, a file truncated under its mapping) fails the `pread`/`pwrite` with `EIO`
/// instead. That is the only reason guestmem uses it, and it needs no signal handler (Rust has
/// no sound `sigsetjmp`/`siglongjmp`).
#[derive(Debug)]
pub(crate) struct ProcMem {
    mem: std::fs::File,
    pagemap: std::fs::File,
}

/// `/proc/self/pagemap` bit: the page is present in RAM.
const PAGEMAP_PRESENT: u64 = 1 << 63;
/// `/proc/self/pagemap` bit: the page is swapped out.
const PAGEMAP_SWAPPED: u64 = 1 << 62;
/// Bytes per `/proc/self/pagemap` entry (one per base page).
const PAGEMAP_ENTRY_BYTES: usize = 8;

impl ProcMem {
    /// Opens `/proc/self/mem` (read-write) and `/proc/self/pagemap`.
    pub(crate) fn open() -> io::Result<ProcMem> {
        use std::fs::OpenOptions;
        Ok(ProcMem {
            mem: OpenOptions::new()
                .read(true)
                .write(true)
                .open("/proc/self/mem")?,
            pagemap: std::fs::File::open("/proc/self/pagemap")?,
        })
    }

    /// Reads the byte at `offset` of `mapping`, faulting its page in for reading.
    pub(crate) fn read_byte(&self, mapping: &Mapping, offset: usize) -> io::Result<u8> {
        use std::os::unix::fs::FileExt;
        let mut b = [0u8; 1];
        match self.mem.read_at(&mut b, address(mapping, offset, 1)?)? {
            1 => Ok(b[0]),
            _ => Err(io::Error::from_raw_os_error(libc::EIO)),
        }
    }

    /// Writes `byte` at `offset` of `mapping`, faulting its page in for writing.
    ///
    /// The caller writes back the byte that is there (or zero into a page never faulted in,
    /// which reads as zero), so the write only has the kernel allocate the page; the memory is
    /// guest memory, which no Rust reference borrows.
    pub(crate) fn write_byte(&self, mapping: &Mapping, offset: usize, byte: u8) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        match self.mem.write_at(&[byte], address(mapping, offset, 1)?)? {
            1 => Ok(()),
            _ => Err(io::Error::from_raw_os_error(libc::EIO)),
        }
    }

    /// For each base page of `offset..offset+len` of `mapping` (`offset` base-page aligned),
    /// whether it has ever been faulted in: present in RAM or swapped out. A private anonymous
    /// page that has not reads as zero.
    pub(crate) fn faulted_in(
        &self,
        mapping: &Mapping,
        offset: usize,
        len: usize,
    ) -> io::Result<Vec<bool>> {
        use std::os::unix::fs::FileExt;
        let page = crate::sys::base_page_size() as usize;
        let addr = address(mapping, offset, len)? as usize;
        let pages = len.div_ceil(page);
        let mut buf = vec![0u8; pages * PAGEMAP_ENTRY_BYTES];
        let at = (addr / page * PAGEMAP_ENTRY_BYTES) as u64;
        self.pagemap.read_exact_at(&mut buf, at)?;
        Ok(buf
            .chunks_exact(PAGEMAP_ENTRY_BYTES)
            .map(|e| {
                let v = u64::from_ne_bytes(e.try_into().expect("8-byte entry"));
                v & (PAGEMAP_PRESENT | PAGEMAP_SWAPPED) != 0
            })
            .collect())
    }
}

/// The host address of `offset..offset+len` of `mapping`, once checked to lie in it.
fn address(mapping: &Mapping, offset: usize, len: usize) -> io::Result<u64> {
    match offset.checked_add(len) {
        Some(end) if end <= mapping.len() => Ok(mapping.as_ptr() as u64 + offset as u64),
        _ => Err(io::Error::from_raw_os_error(libc::EINVAL)),
    }
}
