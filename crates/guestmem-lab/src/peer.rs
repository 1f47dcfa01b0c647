//! What the peers share: a mapping they own (unmapped on drop), the way they fault a range in
//! (one thread per part, `MADV_POPULATE_WRITE`), and their errors. Each peer's own policy
//! (how it maps, how many threads, where it cuts, when it advises THP) lives in its module:
//! [`crate::peer_qemu`], [`crate::peer_ch`].

use std::io;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

use guestmem::inspect::HostRange;
use guestmem::layout::THP_BYTES;
use guestmem::sys::{self, MmapRange};

/// Why a peer could not bring its memory up.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    /// A syscall failed.
    #[error("{peer}: {op} of {len:#x} bytes at host {addr:#x} failed: {source}")]
    Sys {
        /// The peer.
        peer: &'static str,
        /// The call (`mmap`, `madvise(MADV_POPULATE_WRITE)`, ...).
        op: &'static str,
        /// Host address of the range.
        addr: usize,
        /// Length of the range.
        len: usize,
        /// The errno.
        source: io::Error,
    },
    /// A populate thread could not be created.
    #[error("{peer}: creating a populate thread: {source}")]
    Spawn {
        /// The peer.
        peer: &'static str,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// A size that does not fit the address space.
    #[error("{peer}: size {size:#x} does not fit the address space")]
    Size {
        /// The peer.
        peer: &'static str,
        /// The size.
        size: u64,
    },
}

/// `madvise(advice)` on `range`, an error naming `peer`, the call `op` and the range.
pub fn advise(
    peer: &'static str,
    range: MmapRange,
    advice: libc::c_int,
    op: &'static str,
) -> Result<(), PeerError> {
    sys::madvise(range, advice).map_err(|source| PeerError::Sys {
        peer,
        op,
        addr: range.addr(),
        len: range.len(),
        source,
    })
}

/// A read-write private anonymous mapping a peer made; unmapped when dropped.
#[derive(Debug)]
pub struct PeerMapping {
    range: MmapRange,
}

impl PeerMapping {
    /// Wraps `range`, which the caller mapped and now hands over.
    ///
    /// # Safety
    /// `range` must be a mapping this process made and nothing else owns or borrows: it is
    /// unmapped on drop.
    pub(crate) unsafe fn adopt(range: MmapRange) -> PeerMapping {
        PeerMapping { range }
    }

    /// The mapped range.
    pub fn range(&self) -> MmapRange {
        self.range
    }

    /// Whether the mapping starts on a 2 MiB (THP) boundary.
    pub fn is_thp_aligned(&self) -> bool {
        self.range.addr() as u64 % THP_BYTES == 0
    }

    /// The range, for [`guestmem::inspect::inspect_host_ranges`].
    pub fn host_range(&self) -> HostRange {
        HostRange {
            start: self.range.addr() as u64,
            len: self.range.len() as u64,
            huge_align: THP_BYTES,
        }
    }
}

impl Drop for PeerMapping {
    fn drop(&mut self) {
        // Best effort: a failed munmap of our own mapping only leaks address space.
        let _ = sys::munmap(self.range);
    }
}

/// Whether populate threads wait for each other before the first fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// No thread faults until every thread is running and waiting (QEMU's
    /// `threads_created_flag`). In C, a created pthread maps nothing more; a Rust thread maps
    /// its signal stack as it starts, an `mmap` that would queue behind a sibling's populate
    /// holding the address-space lock. So "created" is taken to mean "arrived at the gate",
    /// which is what QEMU's threads are once `qemu_thread_create` returns.
    AllArrived,
    /// Each thread starts faulting as soon as it runs (Cloud Hypervisor, itself in Rust).
    AsCreated,
}

type GateState = (usize, Option<bool>);

/// A start gate: threads arrive and wait until it opens (`true`: work) or is called off.
#[derive(Default)]
pub(crate) struct Gate {
    /// Threads arrived, and the decision once made.
    state: Mutex<GateState>,
    changed: Condvar,
}

impl Gate {
    fn lock(&self) -> MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wait_while<'a>(
        &self,
        g: MutexGuard<'a, GateState>,
        cond: impl FnMut(&mut GateState) -> bool,
    ) -> MutexGuard<'a, GateState> {
        self.changed
            .wait_while(g, cond)
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// A worker: arrive, then wait for the decision.
    pub(crate) fn arrive_and_wait(&self) -> bool {
        let mut g = self.lock();
        g.0 += 1;
        self.changed.notify_all();
        let g = self.wait_while(g, |s| s.1.is_none());
        g.1 == Some(true)
    }

    /// The caller: wait for `n` arrivals, then open.
    pub(crate) fn open_when_arrived(&self, n: usize) {
        drop(self.wait_while(self.lock(), |s| s.0 < n));
        self.decide(true);
    }

    pub(crate) fn decide(&self, go: bool) {
        self.lock().1 = Some(go);
        self.changed.notify_all();
    }
}

/// Faults in each `(offset, len)` part of `mapping` with `MADV_POPULATE_WRITE`, one new
/// thread per part; the calling thread only waits, as both peers' callers do.
pub(crate) fn populate_parts(
    peer: &'static str,
    mapping: &PeerMapping,
    parts: &[(usize, usize)],
    start: Start,
) -> Result<(), PeerError> {
    let gate = Gate::default();
    let results = std::thread::scope(|s| {
        let mut handles = Vec::with_capacity(parts.len());
        for &(offset, len) in parts {
            let part = mapping
                .range()
                .sub(offset, len)
                .expect("peer parts lie inside their mapping");
            let gate = &gate;
            let spawned = std::thread::Builder::new()
                .name(format!("{peer}-populate"))
                .spawn_scoped(s, move || {
                    if start == Start::AllArrived && !gate.arrive_and_wait() {
                        return Ok(());
                    }
                    sys::madvise(part, sys::MADV_POPULATE_WRITE).map_err(|e| (part, e))
                });
            match spawned {
                Ok(h) => handles.push(h),
                Err(source) => {
                    // Call the run off: the threads already created return without work.
                    gate.decide(false);
                    return Err(PeerError::Spawn { peer, source });
                }
            }
        }
        match start {
            Start::AllArrived => gate.open_when_arrived(handles.len()),
            Start::AsCreated => gate.decide(true),
        }
        Ok(handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err((mapping.range(), io::Error::other("thread panicked"))))
            })
            .collect::<Vec<_>>())
    })?;
    for r in results {
        r.map_err(|(part, source)| PeerError::Sys {
            peer,
            op: "madvise(MADV_POPULATE_WRITE)",
            addr: part.addr(),
            len: part.len(),
            source,
        })?;
    }
    Ok(())
}

/// Converts a region size to `usize`.
pub(crate) fn len_of(peer: &'static str, size: u64) -> Result<usize, PeerError> {
    usize::try_from(size).map_err(|_| PeerError::Size { peer, size })
}

/// What a peer brought up: its mappings (kept until dropped) and how.
#[derive(Debug)]
pub struct PeerRun {
    /// One mapping per region, in layout order.
    pub mappings: Vec<PeerMapping>,
    /// Populate threads per region.
    pub threads: Vec<usize>,
}

/// A read-write private anonymous mapping placed at a chosen distance past a 2 MiB boundary,
/// inside a `PROT_NONE` reservation that stays around it: the reservation's `PROT_NONE`
/// neighbours keep the kernel from merging it with any other mapping, so smaps shows its
/// VMAs alone. The whole reservation is unmapped on drop.
#[derive(Debug)]
pub struct PlacedMapping {
    reservation: MmapRange,
    range: MmapRange,
}

impl PlacedMapping {
    /// Maps `len` bytes starting `past_thp` bytes after a 2 MiB boundary (0: 2 MiB aligned;
    /// `past_thp` must be a multiple of the base page and below 2 MiB).
    pub fn map(
        peer: &'static str,
        len: usize,
        past_thp: usize,
    ) -> Result<PlacedMapping, PeerError> {
        let thp = THP_BYTES as usize;
        let page = sys::base_page_size() as usize;
        let sys_err = |op, addr, len, source| PeerError::Sys {
            peer,
            op,
            addr,
            len,
            source,
        };
        let size_err = || PeerError::Size {
            peer,
            size: len as u64,
        };
        if past_thp >= thp || past_thp % page != 0 {
            return Err(size_err());
        }
        // One page below for a neighbour, up to 2 MiB to reach a boundary, `past_thp`, the
        // mapping, and at least one page above it.
        let res_len = len
            .checked_add(past_thp)
            .and_then(|n| n.checked_add(2 * thp))
            .ok_or_else(size_err)?;
        let reservation = sys::reserve(res_len).map_err(|e| sys_err("mmap", 0, res_len, e))?;
        let mut placed = PlacedMapping {
            reservation,
            range: reservation,
        };
        let boundary = (reservation.addr() + page).next_multiple_of(thp);
        let offset = boundary - reservation.addr() + past_thp;
        placed.range = reservation
            .sub(offset, len)
            .expect("the reservation holds the boundary, the offset and the mapping");
        sys::map_fixed(
            placed.range,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            None,
            0,
        )
        .map_err(|e| sys_err("mmap(MAP_FIXED)", placed.range.addr(), len, e))?;
        Ok(placed)
    }

    /// The mapped range (the reservation around it excluded).
    pub fn range(&self) -> MmapRange {
        self.range
    }

    /// The mapped range, for [`guestmem::inspect::inspect_host_ranges`].
    pub fn host_range(&self) -> HostRange {
        HostRange {
            start: self.range.addr() as u64,
            len: self.range.len() as u64,
            huge_align: THP_BYTES,
        }
    }

    /// Makes `offset..offset+len` of the mapping `PROT_NONE`, as a guard page.
    pub fn protect_none(
        &self,
        peer: &'static str,
        offset: usize,
        len: usize,
    ) -> Result<(), PeerError> {
        let part = self.range.sub(offset, len).ok_or(PeerError::Size {
            peer,
            size: (offset as u64).saturating_add(len as u64),
        })?;
        // SAFETY: `part` lies inside this mapping (checked by `sub` just above), which this
        // PlacedMapping owns and which no Rust reference borrows: its users only ever write
        // it through raw pointers or syscalls, so removing access cannot invalidate a borrow.
        let ret = unsafe {
            libc::mprotect(
                part.addr() as *mut libc::c_void,
                part.len(),
                libc::PROT_NONE,
            )
        };
        if ret != 0 {
            return Err(PeerError::Sys {
                peer,
                op: "mprotect(PROT_NONE)",
                addr: part.addr(),
                len: part.len(),
                source: io::Error::last_os_error(),
            });
        }
        Ok(())
    }
}

impl Drop for PlacedMapping {
    fn drop(&mut self) {
        // Best effort: a failed munmap of our own reservation only leaks address space.
        let _ = sys::munmap(self.reservation);
    }
}
