//! The Firecracker-style page server, as a peer for the restore measurements: what
//! Firecracker's example userfaultfd handlers do. One thread; the memory file mapped
//! privately; every fault answered with one 4 KiB `UFFDIO_COPY` from it; no prefetch, no
//! checksum. A lab instrument, not library API (guestmem's own engine is
//! `guestmem::restore`).

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use guestmem::mmap::{MapSource, Mapping, Reservation};
use guestmem::{Region, Reserve};
use linux_raw_sys::general as uapi;
use linux_raw_sys::ioctl as nr;

use guestmem_testkit::firecracker::{uffd_ioctl as ioctl, uffd_open, uffd_register_missing};

const PAGE: u64 = 4096;

/// A running Firecracker-style server; stops (and unregisters) when dropped.
pub struct FcPeer {
    stop: Arc<AtomicBool>,
    faults: Arc<AtomicU64>,
    thread: Option<JoinHandle<io::Result<()>>>,
}

/// The private mapping of the memory file the server copies from, owned (unmapped on
/// drop) as every guestmem mapping is.
struct FileMap {
    /// Keeps it mapped while the server copies from `addr`.
    _map: Mapping,
    addr: usize,
    len: usize,
}

impl FcPeer {
    /// Registers `regions` (fresh, private anonymous memory laid out as the memory file:
    /// region `i` at the sum of the sizes before it) and starts serving from `memory_file`.
    pub fn start(regions: &[Arc<Region>], memory_file: &Path) -> io::Result<FcPeer> {
        let src = map_file(memory_file)?;
        let len = src.len;
        let uffd = uffd_open(0)?;
        // (host start, host end, file offset)
        let mut table = Vec::new();
        let mut off = 0u64;
        for r in regions {
            let start = r.host_addr() as u64;
            // SAFETY: the caller's fresh regions, which this server fills (see `start`).
            unsafe { uffd_register_missing(&uffd, start, r.size()) }?;
            table.push((start, start + r.size(), off));
            off += r.size();
        }
        if off as usize > len {
            return Err(io::Error::other(format!(
                "memory file holds {len:#x} bytes, the regions {off:#x}"
            )));
        }
        let stop = Arc::new(AtomicBool::new(false));
        let faults = Arc::new(AtomicU64::new(0));
        let (s, f) = (stop.clone(), faults.clone());
        // Keep the regions mapped while the server runs.
        let keep: Vec<Arc<Region>> = regions.to_vec();
        let thread = std::thread::Builder::new()
            .name("fc-peer".into())
            .spawn(move || serve(uffd, src, table, s, f, keep))?;
        Ok(FcPeer {
            stop,
            faults,
            thread: Some(thread),
        })
    }

    /// Serves a Firecracker handshake's regions (registered by the peer with `uffd`) from
    /// `memory_file`, the way Firecracker's example handler does.
    pub fn serve_handshake(
        regions: &[guestmem::serve::UffdRegion],
        uffd: OwnedFd,
        memory_file: &Path,
    ) -> io::Result<FcPeer> {
        let src = map_file(memory_file)?;
        let table: Vec<(u64, u64, u64)> = regions
            .iter()
            .map(|r| {
                (
                    r.base_host_virt_addr,
                    r.base_host_virt_addr + r.size,
                    r.offset,
                )
            })
            .collect();
        if let Some(&(_, _, off)) = table
            .iter()
            .find(|&&(s, e, off)| off + (e - s) > src.len as u64)
        {
            return Err(io::Error::other(format!(
                "memory file holds {:#x} bytes, a region starts at offset {off:#x} and runs past it",
                src.len
            )));
        }
        let stop = Arc::new(AtomicBool::new(false));
        let faults = Arc::new(AtomicU64::new(0));
        let (s, f) = (stop.clone(), faults.clone());
        let thread = std::thread::Builder::new()
            .name("fc-peer".into())
            .spawn(move || serve(uffd, src, table, s, f, Vec::new()))?;
        Ok(FcPeer {
            stop,
            faults,
            thread: Some(thread),
        })
    }

    /// Faults served so far.
    pub fn faults(&self) -> u64 {
        self.faults.load(Ordering::Relaxed)
    }

    /// Stops the server; its error, if it failed.
    pub fn stop(mut self) -> io::Result<u64> {
        self.stop.store(true, Ordering::Release);
        let r = self.thread.take().map_or(Ok(()), |t| {
            t.join()
                .unwrap_or_else(|_| Err(io::Error::other("fc-peer panicked")))
        });
        r.map(|()| self.faults())
    }
}

impl Drop for FcPeer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// `path` mapped privately.
fn map_file(path: &Path) -> io::Result<FileMap> {
    let file = File::open(path)?;
    let len = file.metadata()?.len() as usize;
    let res = Reservation::new(len).map_err(|e| e.into_io())?;
    let source = MapSource::PrivateFile {
        fd: file.as_fd(),
        offset: 0,
    };
    // SAFETY: the file is the lab's own memory file, which nothing truncates while a run
    // serves from it (it must not shrink under the mapping).
    let map =
        unsafe { res.place_file(0, len, source, Reserve::Reserve) }.map_err(|e| e.into_io())?;
    Ok(FileMap {
        addr: map.as_ptr() as usize,
        len,
        _map: map,
    })
}

fn serve(
    uffd: OwnedFd,
    src: FileMap,
    table: Vec<(u64, u64, u64)>,
    stop: Arc<AtomicBool>,
    faults: Arc<AtomicU64>,
    _keep: Vec<Arc<Region>>,
) -> io::Result<()> {
    let size = std::mem::size_of::<uapi::uffd_msg>();
    loop {
        let mut pfd = libc::pollfd {
            fd: uffd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd.
        let n = unsafe { libc::poll(&mut pfd, 1, 50) };
        if stop.load(Ordering::Acquire) {
            return Ok(());
        }
        if n <= 0 {
            continue;
        }
        let mut msg = std::mem::MaybeUninit::<uapi::uffd_msg>::uninit();
        // SAFETY: reads at most one message into a buffer of its size.
        let got = unsafe {
            libc::read(
                uffd.as_raw_fd(),
                msg.as_mut_ptr() as *mut libc::c_void,
                size,
            )
        };
        if got != size as isize {
            continue;
        }
        // SAFETY: the kernel wrote a whole message.
        let msg = unsafe { msg.assume_init() };
        if u32::from(msg.event) != uapi::UFFD_EVENT_PAGEFAULT {
            continue;
        }
        // SAFETY: a pagefault message carries the pagefault member.
        let addr = unsafe { msg.arg.pagefault.address } & !(PAGE - 1);
        let Some(&(start, _, off)) = table.iter().find(|&&(s, e, _)| addr >= s && addr < e) else {
            continue;
        };
        let from = off + (addr - start);
        let mut c = uapi::uffdio_copy {
            dst: addr,
            src: (src.addr as u64) + from,
            len: PAGE,
            mode: 0,
            copy: 0,
        };
        // SAFETY: a uffdio_copy for UFFDIO_COPY: `dst` is the faulting page, inside a range
        // this descriptor registered; `src` lies in the file mapping (every region's offset
        // plus size was checked against its length), which `src` keeps mapped.
        match unsafe { ioctl(&uffd, nr::UFFDIO_COPY, &mut c) } {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
            Err(e) => return Err(e),
        }
        faults.fetch_add(1, Ordering::Relaxed);
    }
}
