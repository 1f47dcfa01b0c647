//! A guest workload: vCPU threads running the program of [`super::program`] against the map.
//!
//! The map holds a control region ([`control_spec`]: code, one parameter page per vCPU, and
//! the long-mode page tables) and the data regions the vCPUs write. Each vCPU gets a list of
//! ranges, its slice ([`partition`] or given explicitly); every command (a write pass, a
//! verify) goes to all vCPUs at once and returns when all have reported through port I/O.
//! The host sets `RIP`, `RSI` and `RBX` before every command, so a vCPU never depends on
//! where the previous command left it (KVM completes a pending `out` only if `RIP` is where
//! the exit left it).

use std::os::unix::thread::JoinHandleExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use guestmem::GuestAddress;
use kvm_bindings::kvm_regs;
use kvm_ioctls::{VcpuExit, VcpuFd};

use super::program::{self, CODE_GPA, PAGE_TABLES_GPA, VERIFY_OFFSET};
pub use super::program::{pattern, GuestMode, PORT_PASS_DONE, PORT_VERIFY_DONE};
use super::VmError;
use guestmem::kvm::KvmVm;
use guestmem::layout::{Access, Backing, Guard, RegionSpec, Thp};
use guestmem::plan::EvenLayout;
use guestmem::GuestMap;
use guestmem::Region;

/// Guest address where the data regions start.
pub const DATA_GPA: u64 = 1 << 30;
/// Where they start in long mode: above 4 GiB, clear of the 32-bit MMIO hole (the local
/// APIC at 0xfee00000 would turn a guest write into an MMIO exit).
pub const HIGH_DATA_GPA: u64 = 4 << 30;

/// Where the data regions start in `mode`.
pub fn data_gpa(mode: GuestMode) -> u64 {
    match mode {
        GuestMode::Protected32 => DATA_GPA,
        GuestMode::Long64 => HIGH_DATA_GPA,
    }
}

/// Guest address of the control region (code, parameter blocks, page tables).
pub const CONTROL_GPA: u64 = 0;
/// Size of the control region.
pub const CONTROL_BYTES: u64 = 2 << 20;
/// Guest address of vCPU 0's parameter block; vCPU `i`'s is `i` pages further.
pub const PARAMS_GPA: u64 = 0x1_0000;
/// Most vCPUs a workload runs (one parameter page each, below the page tables).
pub const MAX_VCPUS: usize = ((PAGE_TABLES_GPA - PARAMS_GPA) / PAGE_BYTES) as usize;
/// Most ranges one vCPU's parameter block holds (a `u64` count, then 16 bytes a range).
pub const MAX_ENTRIES: usize = ((PAGE_BYTES - 8) / 16) as usize;

const PAGE_BYTES: u64 = 4096;

/// The control region's spec: code and parameter blocks, at [`CONTROL_GPA`].
pub fn control_spec() -> RegionSpec {
    RegionSpec::new(GuestAddress(CONTROL_GPA), CONTROL_BYTES)
}

/// `bytes` of anonymous, THP-advised, guarded guest memory from `base`, split into `slots`
/// regions of whole 2 MiB pages, the last taking the remainder: [`EvenLayout`] with the
/// defaults.
pub fn data_specs(
    base: GuestAddress,
    bytes: u64,
    slots: usize,
) -> Result<Vec<RegionSpec>, VmError> {
    EvenLayout {
        size: bytes,
        regions: slots as u64,
        base,
        backing: Backing::Anonymous,
        thp: Thp::Huge,
        guard: Guard::On,
    }
    .specs()
    .map_err(|e| VmError::Config(format!("{bytes:#x} bytes into {slots} slots: {e}")))
}

/// How vCPUs share the data regions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Partition {
    /// Every vCPU gets an equal slice of every region (each vCPU crosses every slot).
    PerSlot,
    /// The regions are laid end to end and each vCPU gets one contiguous share, as in KVM's
    /// `dirty_log_perf_test`.
    Contiguous,
}

/// One page-aligned guest range `[start, end)`.
pub type Range = (u64, u64);

/// The ranges each of `vcpus` vCPUs walks in `regions` (sorted by guest address).
pub fn partition(regions: &[Range], vcpus: usize, how: Partition) -> Vec<Vec<Range>> {
    let mut out = vec![Vec::new(); vcpus];
    let n = vcpus as u64;
    match how {
        Partition::PerSlot => {
            for &(start, end) in regions {
                let pages = (end - start) / PAGE_BYTES;
                for (v, slice) in out.iter_mut().enumerate() {
                    let (a, b) = (pages * v as u64 / n, pages * (v as u64 + 1) / n);
                    if a < b {
                        slice.push((start + a * PAGE_BYTES, start + b * PAGE_BYTES));
                    }
                }
            }
        }
        Partition::Contiguous => {
            let total: u64 = regions.iter().map(|(s, e)| (e - s) / PAGE_BYTES).sum();
            for (v, slice) in out.iter_mut().enumerate() {
                let (a, b) = (total * v as u64 / n, total * (v as u64 + 1) / n);
                let mut base = 0;
                for &(start, end) in regions {
                    let pages = (end - start) / PAGE_BYTES;
                    let (lo, hi) = (a.max(base), b.min(base + pages));
                    if lo < hi {
                        slice.push((
                            start + (lo - base) * PAGE_BYTES,
                            start + (hi - base) * PAGE_BYTES,
                        ));
                    }
                    base += pages;
                }
            }
        }
    }
    out
}

/// How many vCPUs to run and how they share the data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkloadConfig {
    /// vCPUs (threads), at most [`MAX_VCPUS`].
    pub vcpus: usize,
    /// How they share the data regions.
    pub partition: Partition,
    /// The CPU mode.
    pub mode: GuestMode,
}

/// What one command returned from every vCPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PassOutcome {
    /// From sending the command to the last vCPU's report.
    pub elapsed: Duration,
    /// Each vCPU's reported value (tag for a write pass, mismatches for a verify).
    pub values: Vec<u32>,
}

enum Cmd {
    Run { rip: u64, tag: u32, port: u16 },
}

type Reply = (usize, Result<u32, VmError>);

struct VcpuThread {
    cmd: Sender<Cmd>,
    handle: Option<JoinHandle<()>>,
}

/// What [`Stopper`] and the vCPU threads share.
#[derive(Debug)]
struct StopState {
    stop: AtomicBool,
    /// Per vCPU: whether its thread is inside `KVM_RUN`.
    in_run: Vec<AtomicBool>,
    /// Per vCPU: its thread, until the thread leaves its loop (it clears its entry, under
    /// the lock, before exiting, so a thread found here is alive while the lock is held).
    threads: Mutex<Vec<Option<libc::pthread_t>>>,
}

/// Stops a workload's vCPUs from any thread, without blocking: what a VMM does when guest
/// memory cannot be delivered (a failed lazy restore). Sets the stop flag, then signals every
/// vCPU thread still in `KVM_RUN` (every 2 ms, up to 2 s) until all are out: a vCPU waiting
/// on a userfaultfd fault leaves `KVM_RUN` with `EINTR`, and the command it was running
/// returns [`VmError::Stopped`].
#[derive(Debug, Clone)]
pub struct Stopper(Arc<StopState>);

/// The signal that kicks a vCPU out of `KVM_RUN` (its handler does nothing).
fn kick_signal() -> libc::c_int {
    libc::SIGRTMIN() + 5
}

extern "C" fn on_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

thread_local! {
    /// Whether this thread is a vCPU inside `KVM_RUN` (const-initialised: safe to read in a
    /// signal handler).
    static IN_KVM_RUN: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// `SIGBUS` while a vCPU is in `KVM_RUN` is KVM reporting guest memory that is lost (a
/// poisoned page: a failed lazy restore): ignored here, `KVM_RUN` returns `EINTR` and the
/// vCPU loop stops. Anywhere else it is a real memory error: the default action (the
/// process dies) is put back and the faulting access repeats into it.
extern "C" fn on_sigbus(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    if !IN_KVM_RUN.with(|c| c.get()) {
        // SAFETY: signal(2) is async-signal-safe.
        unsafe { libc::signal(libc::SIGBUS, libc::SIG_DFL) };
    }
}

/// Installs the vCPU signal handlers (kick and `SIGBUS`), once per process.
fn install_handlers() -> Result<(), VmError> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        // SAFETY: the kick handler does nothing (async-signal-safe); it exists so the kick
        // signal interrupts KVM_RUN instead of killing the process.
        vmm_sys_util::signal::register_signal_handler(kick_signal(), on_kick)
            .map_err(|e| format!("installing the vCPU kick signal handler: {e}"))?;
        // SAFETY: a zeroed sigaction with a handler that only reads a thread-local and calls
        // signal(2), both async-signal-safe.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_sigbus as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO;
            if libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut()) != 0 {
                return Err(format!(
                    "installing the SIGBUS handler: {}",
                    std::io::Error::last_os_error()
                ));
            }
        }
        Ok(())
    })
    .clone()
    .map_err(VmError::Config)
}

impl Stopper {
    /// Stops the vCPUs (see the type's docs). Returns at once.
    pub fn stop(&self) {
        self.0.stop.store(true, Ordering::Release);
        let state = self.0.clone();
        let _ = std::thread::Builder::new()
            .name("vcpu-kicker".into())
            .spawn(move || {
                for _ in 0..1000 {
                    let mut any = false;
                    {
                        let threads = state.threads.lock().unwrap_or_else(|e| e.into_inner());
                        for (t, r) in threads.iter().zip(&state.in_run) {
                            if let (Some(t), true) = (t, r.load(Ordering::Acquire)) {
                                any = true;
                                // SAFETY: the thread is alive: it clears its entry under this
                                // lock before it exits. The signal's handler does nothing.
                                unsafe { libc::pthread_kill(*t, kick_signal()) };
                            }
                        }
                    }
                    if !any {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
            });
    }

    /// Whether [`Stopper::stop`] was called.
    pub fn stopped(&self) -> bool {
        self.0.stop.load(Ordering::Acquire)
    }
}

/// vCPU threads running the workload. Commands go to all vCPUs at once; dropping it stops
/// and joins them.
pub struct Workload {
    threads: Vec<VcpuThread>,
    replies: Mutex<Receiver<Reply>>,
    slices: Vec<Vec<Range>>,
    mode: GuestMode,
    /// When each vCPU first entered the guest (`KVM_RUN`).
    entered: Arc<Vec<OnceLock<Instant>>>,
    stopper: Stopper,
}

impl std::fmt::Debug for Workload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workload")
            .field("vcpus", &self.threads.len())
            .finish()
    }
}

impl Workload {
    /// Loads the program into the control region of `map` (which must hold one, see
    /// [`control_spec`]), writes each vCPU's parameter block for `data`, and starts the vCPU
    /// threads, idle until a command. The map must already be registered with `vm`.
    pub fn start(
        vm: &Arc<KvmVm>,
        map: &GuestMap,
        data: &[Arc<Region>],
        config: WorkloadConfig,
    ) -> Result<Workload, VmError> {
        if config.vcpus == 0 || config.vcpus > MAX_VCPUS {
            return Err(VmError::Config(format!(
                "{} vCPUs asked for, 1..={MAX_VCPUS} supported",
                config.vcpus
            )));
        }
        let mut ranges = Vec::with_capacity(data.len());
        for r in data {
            if r.access() == Access::ReadOnly || r.guest_end() > config.mode.end_limit() {
                return Err(VmError::Config(format!(
                    "region at {:#x}: the guest writes it, so it must be read-write and end below {:#x}",
                    r.guest_addr().0,
                    config.mode.end_limit()
                )));
            }
            ranges.push((r.guest_addr().0, r.guest_end()));
        }
        ranges.sort_unstable();
        let slices = partition(&ranges, config.vcpus, config.partition);
        Workload::start_with_slices(vm, map, slices, config.mode)
    }

    /// As [`Workload::start`], with each vCPU's ranges given: `slices[v]` are the
    /// page-aligned, non-empty ranges vCPU `v` walks, in order, all below
    /// [`GuestMode::end_limit`] and in read-write memory registered with `vm`.
    pub fn start_with_slices(
        vm: &Arc<KvmVm>,
        map: &GuestMap,
        slices: Vec<Vec<Range>>,
        mode: GuestMode,
    ) -> Result<Workload, VmError> {
        let vcpus = slices.len();
        if vcpus == 0 || vcpus > MAX_VCPUS {
            return Err(VmError::Config(format!(
                "{vcpus} vCPUs asked for, 1..={MAX_VCPUS} supported"
            )));
        }
        write_params(map, &slices, mode)?;
        program::load(map, mode)?;

        install_handlers()?;
        let stopper = Stopper(Arc::new(StopState {
            stop: AtomicBool::new(false),
            in_run: (0..vcpus).map(|_| AtomicBool::new(false)).collect(),
            threads: Mutex::new(Vec::new()),
        }));
        let (reply_tx, reply_rx) = channel();
        let mut threads = Vec::with_capacity(vcpus);
        let entered: Arc<Vec<OnceLock<Instant>>> =
            Arc::new((0..vcpus).map(|_| OnceLock::new()).collect());
        for v in 0..vcpus {
            let vcpu = vm.create_vcpu(v as u64)?;
            program::setup_vcpu(&vcpu, mode)?;
            let (cmd_tx, cmd_rx) = channel();
            let replies = reply_tx.clone();
            let entered = entered.clone();
            let stop = stopper.0.clone();
            let handle = std::thread::Builder::new()
                .name(format!("vcpu{v}"))
                .spawn(move || vcpu_loop(v, vcpu, cmd_rx, replies, &entered[v], &stop))
                .map_err(|e| VmError::Thread {
                    vcpu: v,
                    what: e.to_string(),
                })?;
            stopper
                .0
                .threads
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(Some(handle.as_pthread_t()));
            threads.push(VcpuThread {
                cmd: cmd_tx,
                handle: Some(handle),
            });
        }
        Ok(Workload {
            threads,
            replies: Mutex::new(reply_rx),
            slices,
            mode,
            entered,
            stopper,
        })
    }

    /// A handle that stops the vCPUs from any thread.
    pub fn stopper(&self) -> Stopper {
        self.stopper.clone()
    }

    /// When the last vCPU first entered the guest, once all have.
    pub fn all_entered(&self) -> Option<Instant> {
        self.entered
            .iter()
            .map(|e| e.get().copied())
            .collect::<Option<Vec<_>>>()?
            .into_iter()
            .max()
    }

    /// Gives the vCPUs new ranges (one list per vCPU, checked as in
    /// [`Workload::start_with_slices`]); they are idle between commands, so this is safe.
    pub fn set_slices(&mut self, map: &GuestMap, slices: Vec<Vec<Range>>) -> Result<(), VmError> {
        if slices.len() != self.threads.len() {
            return Err(VmError::Config(format!(
                "{} slices given for {} vCPUs",
                slices.len(),
                self.threads.len()
            )));
        }
        write_params(map, &slices, self.mode)?;
        self.slices = slices;
        Ok(())
    }

    /// vCPUs running.
    pub fn vcpus(&self) -> usize {
        self.threads.len()
    }

    /// The ranges vCPU `v` walks.
    pub fn slice(&self, v: usize) -> &[Range] {
        &self.slices[v]
    }

    /// Every vCPU writes [`pattern`]`(gpa, tag)` into the first dword of each page of its
    /// slice, once; returns when all have reported.
    pub fn write_pass(&self, tag: u32) -> Result<PassOutcome, VmError> {
        self.command(CODE_GPA, tag, PORT_PASS_DONE)
    }

    /// Every vCPU checks dwords 0 and 4092 of each page of its slice against
    /// [`pattern`]`(gpa, tag)`; the values are the mismatch counts.
    pub fn verify(&self, tag: u32) -> Result<PassOutcome, VmError> {
        self.command(CODE_GPA + VERIFY_OFFSET, tag, PORT_VERIFY_DONE)
    }

    fn command(&self, rip: u64, tag: u32, port: u16) -> Result<PassOutcome, VmError> {
        let replies = self.replies.lock().unwrap_or_else(|e| e.into_inner());
        let start = Instant::now();
        for (v, t) in self.threads.iter().enumerate() {
            t.cmd
                .send(Cmd::Run { rip, tag, port })
                .map_err(|_| VmError::Thread {
                    vcpu: v,
                    what: "exited".into(),
                })?;
        }
        let mut values = vec![0; self.threads.len()];
        let mut first_err = None;
        for _ in 0..self.threads.len() {
            let (v, r) = replies.recv().map_err(|_| VmError::Thread {
                vcpu: 0,
                what: "all vCPU threads exited".into(),
            })?;
            match r {
                Ok(x) => values[v] = x,
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        let elapsed = start.elapsed();
        match first_err {
            Some(e) => Err(e),
            None => Ok(PassOutcome { elapsed, values }),
        }
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        let handles: Vec<_> = self
            .threads
            .drain(..)
            .filter_map(|mut t| t.handle.take())
            .collect();
        // The command senders are dropped above, which ends every vCPU loop.
        for h in handles {
            let _ = h.join();
        }
    }
}

/// Checks `slices` and writes each vCPU's parameter block.
fn write_params(map: &GuestMap, slices: &[Vec<Range>], mode: GuestMode) -> Result<(), VmError> {
    let limit = mode.end_limit();
    for &(s, e) in slices.iter().flatten() {
        if s >= e || s % PAGE_BYTES != 0 || e % PAGE_BYTES != 0 || e > limit {
            return Err(VmError::Config(format!(
                "range {s:#x}..{e:#x}: must be non-empty, page-aligned and end at most {limit:#x}"
            )));
        }
    }
    let t = map.translator();
    for (v, slice) in slices.iter().enumerate() {
        if slice.len() > MAX_ENTRIES {
            return Err(VmError::Config(format!(
                "vCPU {v} walks {} ranges, at most {MAX_ENTRIES} fit its parameter page",
                slice.len()
            )));
        }
        let mut block = Vec::with_capacity(8 + 16 * slice.len());
        block.extend_from_slice(&(slice.len() as u64).to_le_bytes());
        for &(s, e) in slice {
            block.extend_from_slice(&s.to_le_bytes());
            block.extend_from_slice(&e.to_le_bytes());
        }
        t.write_in_region(GuestAddress(params_gpa(v)), &block)?;
    }

    Ok(())
}

fn params_gpa(v: usize) -> u64 {
    PARAMS_GPA + v as u64 * PAGE_BYTES
}

fn vcpu_loop(
    v: usize,
    mut vcpu: VcpuFd,
    cmds: Receiver<Cmd>,
    replies: Sender<Reply>,
    entered: &OnceLock<Instant>,
    stop: &StopState,
) {
    while let Ok(Cmd::Run { rip, tag, port }) = cmds.recv() {
        let r = run_one(v, &mut vcpu, rip, tag, port, entered, stop);
        if replies.send((v, r)).is_err() {
            break;
        }
    }
    stop.threads.lock().unwrap_or_else(|e| e.into_inner())[v] = None;
}

fn run_one(
    v: usize,
    vcpu: &mut VcpuFd,
    rip: u64,
    tag: u32,
    want: u16,
    entered: &OnceLock<Instant>,
    stop: &StopState,
) -> Result<u32, VmError> {
    let regs = kvm_regs {
        rip,
        rsi: params_gpa(v),
        rbx: u64::from(tag),
        rflags: 0x2,
        ..Default::default()
    };
    vcpu.set_regs(&regs)
        .map_err(|e| VmError::ioctl("KVM_SET_REGS", e))?;
    let in_run = &stop.in_run[v];
    loop {
        if stop.stop.load(Ordering::Acquire) {
            return Err(VmError::Stopped { vcpu: v });
        }
        entered.get_or_init(Instant::now);
        in_run.store(true, Ordering::Release);
        IN_KVM_RUN.with(|c| c.set(true));
        let exit = vcpu.run();
        IN_KVM_RUN.with(|c| c.set(false));
        in_run.store(false, Ordering::Release);
        match exit {
            Ok(VcpuExit::IoOut(port, data)) if port == want && data.len() == 4 => {
                return Ok(u32::from_le_bytes([data[0], data[1], data[2], data[3]]));
            }
            Ok(VcpuExit::Intr) => continue,
            Ok(exit) => {
                return Err(VmError::UnexpectedExit {
                    vcpu: v,
                    exit: format!("{exit:?}"),
                })
            }
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => continue,
            Err(e) => return Err(VmError::ioctl("KVM_RUN", e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partition_per_slot_covers_every_page_once() {
        let regions = [
            (0x10_0000, 0x10_0000 + 10 * 4096),
            (0x40_0000, 0x40_0000 + 3 * 4096),
        ];
        let p = partition(&regions, 4, Partition::PerSlot);
        let pages: u64 = p.iter().flatten().map(|(s, e)| (e - s) / 4096).sum();
        assert_eq!(pages, 13);
        assert_eq!(p[0], [(0x10_0000, 0x10_0000 + 2 * 4096)]);
        assert!(p.iter().all(|s| s.len() <= 2));
    }

    #[test]
    fn partition_contiguous_splits_across_slot_edges() {
        let regions = [(0, 4 * 4096), (0x10_0000, 0x10_0000 + 4 * 4096)];
        let p = partition(&regions, 2, Partition::Contiguous);
        assert_eq!(p[0], [(0, 4 * 4096)]);
        assert_eq!(p[1], [(0x10_0000, 0x10_0000 + 4 * 4096)]);
        let p = partition(&regions, 3, Partition::Contiguous);
        assert_eq!(p[1], [(2 * 4096, 4 * 4096), (0x10_0000, 0x10_0000 + 4096)]);
    }

    #[test]
    fn data_specs_too_small_is_refused() {
        assert!(data_specs(GuestAddress(0), 2 << 20, 2).is_err());
        let s = data_specs(GuestAddress(1 << 30), 10 << 20, 2).unwrap();
        assert_eq!(s[1].guest_addr().0, (1 << 30) + (4 << 20));
        assert_eq!(s[1].size(), 6 << 20);
    }
}
