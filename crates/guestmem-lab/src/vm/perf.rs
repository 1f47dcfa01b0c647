//! The `guestmem-lab vm` engine: a dirty-logging run modelled on KVM's `dirty_log_perf_test`.
//!
//! One VM, `slots` data regions holding `memory_bytes` in all, `vcpus` threads. The vCPUs
//! first touch all memory with dirty logging off ("populate memory time"); dirty logging is
//! then enabled on every slot, and each pass has every vCPU write one dword per page of its
//! share ("dirty memory time"), after which the host harvests every slot's log ("get dirty
//! log time") and, with manual protection, re-protects ("clear dirty log time"). Each
//! harvest is checked: KVM must report exactly the pages the guest wrote.
//!
//! Seed 004 measured this test with 64 vCPUs and 64 memslots; the per-vCPU last-used slot
//! cut the dirty pass from 2.8 s to 0.3 s.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use guestmem::GuestAddress;

use super::guest::{self, GuestMode, Partition, Workload, WorkloadConfig};
use super::VmError;
use guestmem::dirty::DirtyPages;
use guestmem::kvm::{DirtyLogging, MemslotConfig, Memslots};
use guestmem::kvm::{KvmCaps, KvmVm, VmConfig};
use guestmem::snapshot::SaveReport;

use super::restore_run;
pub use super::restore_run::{RestoreRun, RestoreRunReport, TAG_KEY};
use guestmem::{
    bringup, bringup_background, BringupConfig, GuestMap, PinStrategy, PopulateConfig, Verify,
};

pub use super::guest::{data_gpa, DATA_GPA, HIGH_DATA_GPA};

/// What to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PerfConfig {
    /// Guest data memory in bytes (a multiple of 2 MiB per slot).
    pub memory_bytes: u64,
    /// vCPUs.
    pub vcpus: usize,
    /// Data memslots.
    pub slots: usize,
    /// Dirty passes after the populate pass.
    pub passes: usize,
    /// How vCPUs share memory.
    pub partition: Partition,
    /// The guest's CPU mode: 32-bit reaches memory below 4 GiB, long mode below 64 GiB.
    pub mode: GuestMode,
    /// How to open KVM.
    pub vm: VmConfig,
    /// Whether the host populates guest memory before, beside or not at all before the
    /// guest's first pass.
    pub prefault: Prefault,
    /// Start from a snapshot instead of fresh memory: the guest first verifies every page it
    /// wrote before the save.
    pub restore: Option<RestoreRun>,
    /// Save guest memory here after the passes.
    pub save: Option<PathBuf>,
}

/// How guest memory is faulted in before the guest's first pass.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Prefault {
    /// Not at all: the guest's own first touches fault it in (through KVM).
    #[default]
    None,
    /// The host populates it all (guestmem's parallel populate), then vCPUs start.
    Blocking,
    /// vCPUs start at once while the host populates behind them
    /// (`guestmem::bringup_background`), the control region (code, page tables) first.
    Background,
}

impl Default for PerfConfig {
    fn default() -> Self {
        PerfConfig {
            memory_bytes: 256 << 20,
            vcpus: 4,
            slots: 64,
            passes: 3,
            partition: Partition::Contiguous,
            mode: GuestMode::Protected32,
            vm: VmConfig::default(),
            prefault: Prefault::None,
            restore: None,
            save: None,
        }
    }
}

/// One dirty pass.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PassReport {
    /// Iteration number as `dirty_log_perf_test` counts (populate is 1).
    pub iteration: usize,
    /// Time until every vCPU finished the pass, seconds.
    pub dirty_memory_secs: f64,
    /// Time in `KVM_GET_DIRTY_LOG` over all slots, seconds.
    pub get_dirty_log_secs: f64,
    /// Time in `KVM_CLEAR_DIRTY_LOG` over all slots, seconds.
    pub clear_dirty_log_secs: f64,
    /// Data pages KVM reported dirty (checked equal to the pages written).
    pub dirty_pages: u64,
}

/// The result of a run.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PerfReport {
    /// Data memory, bytes.
    pub memory_bytes: u64,
    /// vCPUs.
    pub vcpus: usize,
    /// Data memslots (one more holds code and parameters).
    pub slots: usize,
    /// How vCPUs shared memory.
    pub partition: Partition,
    /// The guest's CPU mode.
    pub mode: GuestMode,
    /// What KVM offered.
    pub caps: KvmCaps,
    /// How memory was prefaulted.
    pub prefault: Prefault,
    /// The host's populate of all guest memory, seconds (0 with [`Prefault::None`]; with
    /// [`Prefault::Background`], from its start to its end, beside the guest).
    pub prefault_secs: f64,
    /// From the start of the run (before mapping) until every vCPU had entered the guest,
    /// seconds.
    pub guest_start_secs: f64,
    /// From the start of the run until the end of the guest's first pass, seconds.
    pub first_pass_done_secs: f64,
    /// The guest's first pass over all memory (dirty logging off), seconds: with no
    /// prefault, its first touch of every page.
    pub populate_memory_secs: f64,
    /// Turning dirty logging on for every slot, seconds.
    pub enable_dirty_logging_secs: f64,
    /// Each dirty pass.
    pub passes: Vec<PassReport>,
    /// Mean dirty memory time, seconds.
    pub avg_dirty_memory_secs: f64,
    /// Mean get-dirty-log time, seconds.
    pub avg_get_dirty_log_secs: f64,
    /// Mean clear-dirty-log time, seconds.
    pub avg_clear_dirty_log_secs: f64,
    /// Turning dirty logging off again, seconds.
    pub disable_dirty_logging_secs: f64,
    /// Warnings from registering the slots.
    pub warnings: Vec<String>,
    /// The restore, when the run started from a snapshot.
    pub restore: Option<RestoreRunReport>,
    /// The save after the passes.
    pub save: Option<SaveReport>,
}

/// Runs the test that `config` describes: the map (fresh or restored), KVM and its slots,
/// the prefault, the guest's first pass (a restored guest verifies first), the dirty passes,
/// then the restore's finish and the save.
pub fn run(config: &PerfConfig) -> Result<PerfReport, VmError> {
    let t0 = std::time::Instant::now();
    check_reach(config)?;
    let mut config = config.clone();
    let (map, restoring) = open_map(&mut config, t0)?;
    let config = &config;
    let (vm, mut slots, warnings) = register(config, &map)?;
    let data: Vec<_> = map
        .view()
        .regions()
        .iter()
        .filter(|r| r.guest_addr().0 >= DATA_GPA)
        .cloned()
        .collect();
    let (background, mut prefault_secs) = start_prefault(config.prefault, &map)?;
    let work = Workload::start(
        &vm,
        &map,
        &data,
        WorkloadConfig {
            vcpus: config.vcpus,
            partition: config.partition,
            mode: config.mode,
        },
    )?;
    let pages_written: u64 = (0..work.vcpus())
        .flat_map(|v| work.slice(v).iter())
        .map(|(s, e)| (e - s) / 4096)
        .sum();
    let restore_report = match &restoring {
        None => None,
        Some(started) => Some(started.verify(&work, &data, pages_written, t0)?),
    };
    let populate = work
        .write_pass(1)
        .map_err(|e| restore_run::failed(restoring.as_ref(), e))?
        .elapsed;
    let first_pass_done = t0.elapsed();
    let guest_start = work
        .all_entered()
        .map_or(Duration::ZERO, |t| t.saturating_duration_since(t0));
    if let Some(handle) = background {
        prefault_secs = handle.wait()?.seconds("populate");
    }
    let logged = dirty_passes(config.passes, &work, &mut slots, &data, pages_written)?;
    drop(work);
    let restore = match (restoring, restore_report) {
        (Some(started), Some(report)) => Some(started.finish(report)?),
        _ => None,
    };
    let save = match &config.save {
        None => None,
        Some(dir) => Some(restore_run::save(
            &map,
            &data,
            (config.passes + 1) as u32,
            dir,
        )?),
    };
    let mean = |f: fn(&PassReport) -> f64| {
        let n = logged.passes.len().max(1) as f64;
        logged.passes.iter().map(f).sum::<f64>() / n
    };
    Ok(PerfReport {
        memory_bytes: config.memory_bytes,
        vcpus: config.vcpus,
        slots: config.slots,
        partition: config.partition,
        mode: config.mode,
        caps: *vm.caps(),
        prefault: config.prefault,
        prefault_secs,
        guest_start_secs: secs(guest_start),
        first_pass_done_secs: secs(first_pass_done),
        populate_memory_secs: secs(populate),
        enable_dirty_logging_secs: secs(logged.enable),
        avg_dirty_memory_secs: mean(|p| p.dirty_memory_secs),
        avg_get_dirty_log_secs: mean(|p| p.get_dirty_log_secs),
        avg_clear_dirty_log_secs: mean(|p| p.clear_dirty_log_secs),
        passes: logged.passes,
        disable_dirty_logging_secs: secs(logged.disable),
        warnings,
        restore,
        save,
    })
}

/// A KVM VM with every region of `map` as a memslot, dirty logging off; the warnings of
/// registering them.
fn register(
    config: &PerfConfig,
    map: &GuestMap,
) -> Result<(Arc<KvmVm>, Memslots, Vec<String>), VmError> {
    let vm = Arc::new(KvmVm::open(&config.vm)?);
    let mut slots = Memslots::new(
        vm.clone(),
        MemslotConfig {
            dirty_logging: DirtyLogging::Off,
            max_slots: None,
        },
    )?;
    let warnings = slots.sync(&map.view())?.warnings;
    Ok((vm, slots, warnings))
}

/// Refuses data memory the guest's mode cannot reach.
fn check_reach(config: &PerfConfig) -> Result<(), VmError> {
    let limit = config.mode.end_limit();
    let data_base = data_gpa(config.mode);
    if data_base
        .checked_add(config.memory_bytes)
        .is_none_or(|end| end > limit)
    {
        return Err(VmError::Config(format!(
            "{:#x} bytes from {data_base:#x} asked for; a {:?} guest reaches below {limit:#x} only",
            config.memory_bytes, config.mode
        )));
    }
    Ok(())
}

/// The guest's map: fresh data slots and the control region, or a snapshot's (and then the
/// config's size and slot count become the snapshot's).
fn open_map(
    config: &mut PerfConfig,
    t0: std::time::Instant,
) -> Result<(GuestMap, Option<restore_run::Started>), VmError> {
    match &config.restore {
        None => {
            let data_base = data_gpa(config.mode);
            let mut specs =
                guest::data_specs(GuestAddress(data_base), config.memory_bytes, config.slots)?;
            specs.push(guest::control_spec());
            Ok((GuestMap::from_specs(&specs)?, None))
        }
        Some(run) => {
            let (map, started) = restore_run::start(run, t0)?;
            let data = started.data_regions();
            config.memory_bytes = data.iter().map(|r| r.size).sum();
            config.slots = data.len();
            Ok((map, Some(started)))
        }
    }
}

/// Populates guest memory as `prefault` says: the handle of a background bring-up, or the
/// seconds a blocking one took.
fn start_prefault(
    prefault: Prefault,
    map: &GuestMap,
) -> Result<(Option<guestmem::BringupHandle>, f64), VmError> {
    let cfg = BringupConfig {
        populate: PopulateConfig {
            pin: PinStrategy::None,
            // The control region first: the guest's code, parameters and page tables.
            first: vec![(GuestAddress(guest::CONTROL_GPA), guest::CONTROL_BYTES)],
            ..PopulateConfig::default()
        },
        verify: Verify::Off,
        ..BringupConfig::default()
    };
    Ok(match prefault {
        Prefault::None => (None, 0.0),
        Prefault::Blocking => (None, bringup(&map.view(), &cfg)?.seconds("populate")),
        Prefault::Background => (Some(bringup_background(map, &cfg)?), 0.0),
    })
}

/// What the dirty-logging passes measured.
struct Logged {
    enable: Duration,
    passes: Vec<PassReport>,
    disable: Duration,
}

/// Dirty logging on, `n` passes each harvested and checked (KVM must report exactly the
/// pages written), dirty logging off.
fn dirty_passes(
    n: usize,
    work: &Workload,
    slots: &mut Memslots,
    data: &[Arc<guestmem::Region>],
    pages_written: u64,
) -> Result<Logged, VmError> {
    let t = std::time::Instant::now();
    slots.set_dirty_logging(DirtyLogging::On)?;
    let enable = t.elapsed();
    let mut passes = Vec::with_capacity(n);
    let mut words = Vec::new();
    for i in 0..n {
        let iteration = i + 2;
        let dirty = work.write_pass(iteration as u32)?.elapsed;
        let h = slots.harvest()?;
        // Count the data slots only: in long mode the control slot also logs the page-table
        // pages whose accessed/dirty bits the CPU sets.
        let mut dirty_pages = 0;
        for r in data {
            if let Some(b) = slots.bitmap(r.guest_addr()) {
                b.take(&mut words);
                dirty_pages += DirtyPages::new(&words).count() as u64;
            }
        }
        if dirty_pages != pages_written {
            return Err(VmError::Config(format!(
                "iteration {iteration}: KVM reported {dirty_pages} dirty data pages, the guest wrote {pages_written}"
            )));
        }
        passes.push(PassReport {
            iteration,
            dirty_memory_secs: dirty.as_secs_f64(),
            get_dirty_log_secs: h.get.as_secs_f64(),
            clear_dirty_log_secs: h.clear.as_secs_f64(),
            dirty_pages,
        });
    }
    let t = std::time::Instant::now();
    slots.set_dirty_logging(DirtyLogging::Off)?;
    Ok(Logged {
        enable,
        passes,
        disable: t.elapsed(),
    })
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

impl std::fmt::Display for PerfReport {
    /// The report in `dirty_log_perf_test`'s words.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{} MiB, {} vCPUs, {} memslots, partition {:?}, mode {:?}, manual protect {}",
            self.memory_bytes >> 20,
            self.vcpus,
            self.slots,
            self.partition,
            self.mode,
            self.caps.manual_protect
        )?;
        if let Some(r) = &self.restore {
            writeln!(
                f,
                "Restore ({}, {:?}, prefetch {:?}) setup time: {:.6}s",
                r.server, r.mode, r.prefetch, r.setup_secs
            )?;
        }
        writeln!(
            f,
            "Prefault ({:?}) time: {:.6}s",
            self.prefault, self.prefault_secs
        )?;
        writeln!(f, "Guest start time: {:.6}s", self.guest_start_secs)?;
        if let Some(r) = &self.restore {
            writeln!(
                f,
                "Verify pass done after: {:.6}s ({} pages in {:.6}s, {} mismatches)",
                r.verify_done_secs, r.verify_pages, r.verify_secs, r.mismatches
            )?;
            writeln!(
                f,
                "Overall demand paging rate: {:.1} pgs/sec",
                r.demand_paging_pages_per_sec
            )?;
            writeln!(
                f,
                "Huge-page coverage after restore: {:.1}%",
                r.huge_coverage * 100.0
            )?;
        }
        self.fmt_passes(f)?;
        self.fmt_restore_and_save(f)
    }
}

impl PerfReport {
    /// The guest's passes: populate, dirty logging on, each dirty pass, off, the means.
    fn fmt_passes(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "Populate memory time: {:.6}s", self.populate_memory_secs)?;
        writeln!(
            f,
            "First pass done after: {:.6}s",
            self.first_pass_done_secs
        )?;
        writeln!(
            f,
            "Enabling dirty logging time: {:.6}s",
            self.enable_dirty_logging_secs
        )?;
        for p in &self.passes {
            writeln!(
                f,
                "Iteration {} dirty memory time: {:.6}s",
                p.iteration, p.dirty_memory_secs
            )?;
            writeln!(
                f,
                "Iteration {} get dirty log time: {:.6}s",
                p.iteration, p.get_dirty_log_secs
            )?;
            writeln!(
                f,
                "Iteration {} clear dirty log time: {:.6}s ({} pages)",
                p.iteration, p.clear_dirty_log_secs, p.dirty_pages
            )?;
        }
        writeln!(
            f,
            "Disabling dirty logging time: {:.6}s",
            self.disable_dirty_logging_secs
        )?;
        writeln!(
            f,
            "Average over {} passes: dirty memory {:.6}s, get dirty log {:.6}s, clear dirty log {:.6}s",
            self.passes.len(),
            self.avg_dirty_memory_secs,
            self.avg_get_dirty_log_secs,
            self.avg_clear_dirty_log_secs
        )
    }

    /// What the lazy restore, the Firecracker-style peer and the save did.
    fn fmt_restore_and_save(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(l) = self.restore.as_ref().and_then(|r| r.lazy.as_ref()) {
            writeln!(
                f,
                "Lazy restore: {} faults waited on {} handler threads ({} blocks served for faults, {} on a block in flight, {} late), {} blocks prefetched on {} threads, {} zero, all in after {}",
                l.faults,
                l.handler_threads,
                l.fault_blocks,
                l.faults_on_busy,
                l.faults_late,
                l.prefetched_blocks,
                l.prefetch_threads,
                l.zero_blocks,
                l.complete_secs.map_or("-".into(), |s| format!("{s:.6}s"))
            )?;
        }
        if let Some(n) = self.restore.as_ref().and_then(|r| r.peer_faults) {
            writeln!(
                f,
                "Firecracker-style peer: {n} faults served, one 4 KiB page each"
            )?;
        }
        if let Some(r) = self.restore.as_ref().filter(|r| r.recorded_blocks > 0) {
            writeln!(f, "Recorded working set: {} blocks", r.recorded_blocks)?;
        }
        if let Some(s) = &self.save {
            writeln!(
                f,
                "Saved {} MiB to {} in {:.6}s ({} MiB written, {} blocks, {} threads)",
                s.memory_bytes >> 20,
                s.dir.display(),
                s.seconds,
                s.bytes_written >> 20,
                s.blocks,
                s.threads
            )?;
        }
        Ok(())
    }
}
