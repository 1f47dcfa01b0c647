//! What the VM reads and what the diff rewrites: a deterministic generator, the working set
//! (runs at random places, in a random order), the VM's reads, each word checked, and a
//! diff file of scattered pages.

use std::path::Path;
use std::time::{Duration, Instant};

use super::{err, ObjectStoreLabConfig};
use crate::error::LabError;
use guestmem_testkit::firecracker::{word, Standin, PAGE};

/// A small deterministic generator (xorshift64*).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = (self.next() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
    }
}

/// The working set: runs (byte offsets), in the order the VM reads them.
pub(super) fn working_set(cfg: &ObjectStoreLabConfig) -> Vec<u64> {
    let runs = cfg.size / cfg.ws_run;
    let want = ((cfg.size as f64 * cfg.ws_fraction) / cfg.ws_run as f64).ceil() as u64;
    let mut all: Vec<u64> = (0..runs).collect();
    let mut rng = Rng(0x005e_ed0b_1ec7);
    rng.shuffle(&mut all);
    all.truncate(want.min(runs) as usize);
    all.iter().map(|r| r * cfg.ws_run).collect()
}

/// Writes a diff of `mem` into `path`: a sparse file holding `fraction` of its pages,
/// scattered, each rewritten. The bytes written.
pub(super) fn diff_file(path: &Path, size: u64, fraction: f64) -> Result<u64, LabError> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::create(path).map_err(err)?;
    f.set_len(size).map_err(err)?;
    let pages = size / PAGE as u64;
    let mut all: Vec<u64> = (0..pages).collect();
    let mut rng = Rng(0xd1ff_5eed);
    rng.shuffle(&mut all);
    all.truncate((pages as f64 * fraction) as usize);
    all.sort_unstable();
    let mut buf = vec![0u8; PAGE];
    for &p in &all {
        for c in buf.chunks_exact_mut(8) {
            c.copy_from_slice(&rng.next().to_ne_bytes());
        }
        f.write_all_at(&buf, p * PAGE as u64).map_err(err)?;
    }
    Ok(all.len() as u64 * PAGE as u64)
}

/// What one VM read.
pub(super) struct VmRead {
    pub(super) ws: Duration,
    pub(super) all: Duration,
    pub(super) at_ws: (u64, u64),
    /// With `stalls_by`: how long the VM waited at its first touch of each frame of its
    /// working set, microseconds (its fault, a fault thread, the GET or the one it joined,
    /// the install: a demand miss as the VM sees it).
    pub(super) stalls_us: Vec<f64>,
    /// The reader's own CPU time until it had read its working set, and until it ended,
    /// seconds (its thread is gone before the round's last look at every thread's).
    pub(super) cpu: (f64, f64),
}

/// The calling thread's CPU time, seconds.
fn thread_cpu() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a timespec the call writes.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

/// Reads one word of each page of `runs` (each `run` bytes), then of all memory if `all`,
/// checking each against the file; `at_ws` is called once the working set is read. With
/// `stalls_by` (a frame's bytes), the first touch of each frame of the working set is
/// timed: for a VM that nothing is prefetched for, each is a fault.
pub(super) fn read_vm(
    vm: &Standin,
    runs: &[u64],
    run: u64,
    all: bool,
    t0: Instant,
    at_ws: &(dyn Fn() -> (u64, u64) + Sync),
    stalls_by: Option<u64>,
) -> Result<VmRead, String> {
    let check = |at: usize| {
        let got = vm.word(at);
        if got != word(at as u64) {
            return Err(format!(
                "word at {at:#x}: {got:#x}, the file holds {:#x}",
                word(at as u64)
            ));
        }
        Ok(())
    };
    let mut stalls_us = Vec::new();
    // Each frame's first touch only (a frame larger than a run is met again later,
    // installed by then).
    let mut touched = std::collections::HashSet::new();
    for &r in runs {
        for p in (r..r + run).step_by(PAGE) {
            match stalls_by {
                Some(fb) if touched.insert(p / fb) => {
                    let t = Instant::now();
                    check(p as usize)?;
                    stalls_us.push(t.elapsed().as_secs_f64() * 1e6);
                }
                _ => check(p as usize)?,
            }
        }
    }
    let ws = t0.elapsed();
    let cpu_ws = thread_cpu();
    let counts = at_ws();
    if all {
        for p in (0..vm.size()).step_by(PAGE) {
            check(p)?;
        }
    }
    Ok(VmRead {
        ws,
        all: t0.elapsed(),
        at_ws: counts,
        stalls_us,
        cpu: (cpu_ws, thread_cpu()),
    })
}
