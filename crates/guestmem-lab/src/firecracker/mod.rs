//! The firecracker scenario: restores of a real Firecracker VM (issue 20, item 3), served
//! by Firecracker's own memory backends and by guestmem's page server, side by side.
//!
//! The shared guest (`guest.elf` beside the Firecracker binary, see
//! `../shared/firecracker/README.md`) fills 512 MiB from guest-physical 64 MiB and waits; it
//! is booted twice at once (so the two fills of ~35 s overlap), with [`DEFAULT_MEM_MIB`] MiB,
//! once in 4 KiB pages and once in 2 MiB hugetlb pages (`"huge_pages": "2M"`, a pool reserved
//! for the run by `guestmem_testkit::HugePool2M` and always given back), each paused and snapshotted
//! (Full) into the scratch folder. Then every round restores each variant into a fresh
//! Firecracker process (`snapshot/load`, `resume_vm: true`):
//!
//! - `file`: `mem_backend` File: Firecracker maps the memory file itself (its default);
//! - `fc-on-demand`, `fc-fault-all`: Firecracker's two example handlers
//!   (`uffd_on_demand_handler`: one 4 KiB `UFFDIO_COPY` per fault; `uffd_fault_all_handler`:
//!   the whole file on the first fault), processes beside the binary, on a Uffd socket;
//! - `guestmem-4k`: guestmem's page server in this process
//!   ([`guestmem::serve::Server`] of one VM) set as `guestmem serve-uffd --once` sets it
//!   by default: a handler thread per CPU, 1 MiB blocks, one prefetch thread from the
//!   handshake on (reading ahead of the latest fault first); on the 4 KiB snapshot;
//! - `guestmem-4k-faults`: the same without prefetch (`--prefetch-threads 0`): blocks come in
//!   only when faulted;
//! - `guestmem-4k-noregain`: the same as `guestmem-4k` without the collapse to huge pages
//!   (`--regain-huge-pages off`), to see whether the collapse costs the guest;
//! - `guestmem-2m`: the same on the 2 MiB hugetlb snapshot (Firecracker restores a hugetlb
//!   guest only through Uffd; the restored VM maps fresh pool pages).
//!
//! **What is measured**, per round: from sending `snapshot/load` to its HTTP reply (`load`),
//! and from sending `snapshot/load` to the guest's `TOUCH` line, `t` being sent as soon as the
//! load returned (`first full touch`: the guest reads two words of every one of its 131072
//! pages), then the same pass again (`resident pass`: every page in and mapped, so the
//! guest's own work, which on this host's emulating `/dev/kvm` is most of a pass and drifts
//! with the host's load); `restore cost` is the first less the second, round by round, and
//! each variant's first full touch is also put over `file`'s of the same round. Each in two
//! page-cache states of the memory file: `warm` (read whole just
//! before) and `cold` (written back and dropped with `POSIX_FADV_DONTNEED` just before). The
//! share of the file cached when the round starts is read with `mincore` and recorded, so the
//! state is verified, not trusted; `cold` is this VM's page cache only (the host below may
//! still cache the disk). Also recorded: the Firecracker process's page faults (minor,
//! major) and, for guestmem, the server's report (faults, blocks in) and its phases from the
//! load: the handshake (when its log line said the regions arrived), the first fault and
//! every block in (the engine's clock, which starts just after the handshake, added to it,
//! so these two are a little early). Without prefetch a block comes in only when faulted,
//! and this guest never touches most of its first 64 MiB: every block in is then `n/a`.
//! guestmem's server collapses the VM's memory to huge pages a second after all of it is in
//! (`--regain-huge-pages`, on by default; `REGAIN_SETTLE`), mostly after the first full
//! touch; the resident pass waits until that collapse has ended (its huge pages stop
//! growing), so that it is the guest's own work, and the huge pages then are recorded.
//!
//! **Checked**: every round's `TOUCH` must say `BAD 0`; in each variant's last round, per
//! cache state, `g` then checks every qword (`PASS … BAD 0`). Anything else fails the
//! scenario, naming the variant. Warm-up rounds are run and recorded, not summarised;
//! variants are interleaved round by round. Without a Firecracker binary, `/dev/kvm`,
//! userfaultfd or the guest, the scenario writes a result that says why it did not run; a
//! variant whose handler or hugetlb pool is missing is left out with its reason.

mod report;
mod round;

pub mod host;
use guestmem_testkit::firecracker::vmm;

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::error::LabError;
use crate::report::LabResult;
use crate::run::{
    available_cpus, in_work_dir, ratio, summarise, thp_mode, Order, Protocol, RunInfo, Sampled,
    Summary,
};
use guestmem_testkit::HugePool2M;
use round::measure;
use vmm::Vmm;

/// The scenario's name.
pub const SCENARIO: &str = "firecracker";
/// Default guest memory, MiB: the shared guest fills and touches [64 MiB, 576 MiB).
pub const DEFAULT_MEM_MIB: u64 = 576;
/// The end of the shared guest's region, MiB: less memory and it faults outside it.
const GUEST_END_MIB: u64 = 576;
/// How long a boot has to fill and say `READY` (two fills share the CPUs).
const BOOT_LIMIT: Duration = Duration::from_secs(600);
/// How long a `t` or `g` pass may take after a restore.
const PASS_LIMIT: Duration = Duration::from_secs(300);
/// How long a page server or handler has to listen, or a VM to connect to it.
const SOCKET_LIMIT: Duration = Duration::from_secs(60);

/// A memory file's page-cache state when a round starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Cache {
    /// Read whole just before.
    Warm,
    /// Written back and dropped (`POSIX_FADV_DONTNEED`) just before.
    Cold,
}

impl Cache {
    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Cache::Warm => "warm",
            Cache::Cold => "cold",
        }
    }
}

/// One way of restoring the VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    /// Firecracker's File memory backend.
    File,
    /// Firecracker's `uffd_on_demand_handler`.
    FcOnDemand,
    /// Firecracker's `uffd_fault_all_handler`.
    FcFaultAll,
    /// guestmem's page server, 4 KiB snapshot.
    Guestmem4k,
    /// guestmem's page server without prefetch (`--prefetch-threads 0`), 4 KiB snapshot.
    Guestmem4kFaults,
    /// guestmem's page server without the collapse to huge pages once all is in
    /// (`--regain-huge-pages off`), 4 KiB snapshot.
    Guestmem4kNoRegain,
    /// guestmem's page server, 2 MiB hugetlb snapshot.
    Guestmem2m,
}

impl Variant {
    /// Every variant, in report order.
    pub const ALL: [Variant; 7] = [
        Variant::File,
        Variant::FcOnDemand,
        Variant::FcFaultAll,
        Variant::Guestmem4k,
        Variant::Guestmem4kFaults,
        Variant::Guestmem4kNoRegain,
        Variant::Guestmem2m,
    ];

    /// Its name (`--only` and reports).
    pub fn name(self) -> &'static str {
        match self {
            Variant::File => "file",
            Variant::FcOnDemand => "fc-on-demand",
            Variant::FcFaultAll => "fc-fault-all",
            Variant::Guestmem4k => "guestmem-4k",
            Variant::Guestmem4kFaults => "guestmem-4k-faults",
            Variant::Guestmem4kNoRegain => "guestmem-4k-noregain",
            Variant::Guestmem2m => "guestmem-2m",
        }
    }

    /// Whether it restores the 2 MiB hugetlb snapshot.
    fn huge(self) -> bool {
        self == Variant::Guestmem2m
    }

    /// Whether guestmem's server collapses its memory to huge pages once all is in (the
    /// 4 KiB variants with `--regain-huge-pages on`; faults alone never bring all of this
    /// guest's memory in, so its collapse never starts).
    fn regains(self) -> bool {
        self == Variant::Guestmem4k
    }

    /// The example handler binary it runs, beside `firecracker`.
    fn handler(self) -> Option<&'static str> {
        match self {
            Variant::FcOnDemand => Some("uffd_on_demand_handler"),
            Variant::FcFaultAll => Some("uffd_fault_all_handler"),
            _ => None,
        }
    }
}

/// How to run the scenario (also its recorded settings).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FirecrackerLabConfig {
    /// The Firecracker binary; its folder holds `guest.elf` and the example handlers. `None`
    /// (or a path that does not exist): the scenario says so and does not run.
    pub firecracker: Option<PathBuf>,
    /// Guest memory, MiB (at least the guest's 576).
    pub mem_mib: u64,
    /// guestmem's handler threads (`serve-uffd`'s default: the CPUs).
    pub server_threads: usize,
    /// Which variants run (empty: all there are).
    #[serde(default)]
    pub only: Vec<String>,
    /// The page-cache states each variant is measured in.
    pub caches: Vec<Cache>,
    /// Where snapshots and sockets go (removed afterwards).
    pub work_dir: PathBuf,
    /// Warm-up, rounds, order.
    pub protocol: Protocol,
    /// The command line to record.
    #[serde(skip)]
    pub command: String,
    /// THP mode (recorded).
    #[serde(default)]
    pub thp_mode: String,
}

impl Default for FirecrackerLabConfig {
    fn default() -> Self {
        let fc = vmm::shared_dir().join("firecracker");
        FirecrackerLabConfig {
            firecracker: fc.exists().then_some(fc),
            mem_mib: DEFAULT_MEM_MIB,
            server_threads: available_cpus(),
            only: Vec::new(),
            caches: vec![Cache::Warm, Cache::Cold],
            work_dir: std::env::temp_dir()
                .join(format!("guestmem-lab-firecracker-{}", std::process::id())),
            protocol: Protocol {
                warmup: 1,
                rounds: 5,
                order: Order::default(),
            },
            command: String::new(),
            thp_mode: String::new(),
        }
    }
}

/// What guestmem's page server reported for one restore, and when its phases came, seconds
/// from sending `snapshot/load`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ServerSample {
    /// When the handshake (regions and userfaultfd) had arrived.
    pub handshake_secs: Option<f64>,
    /// When the first fault was read.
    pub first_fault_secs: Option<f64>,
    /// When every block was in (`None`: not all were before the VM went).
    pub all_in_secs: Option<f64>,
    /// Fault messages read.
    pub faults: u64,
    /// Blocks brought in for faults.
    pub fault_blocks: u64,
    /// Blocks in all.
    pub blocks: u64,
    /// Bytes read from the memory file and installed.
    pub bytes_copied: u64,
}

/// One restore of one variant.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FcSample {
    /// From sending `snapshot/load` to its reply, seconds.
    pub load_secs: f64,
    /// From sending `snapshot/load` to the guest's `TOUCH` line, seconds.
    pub touch_secs: f64,
    /// The same `t` pass sent again right after, every page resident and mapped: the
    /// guest's own work, seconds (from sending `t` to its `TOUCH` line).
    #[serde(default)]
    pub resident_secs: f64,
    /// The share of the memory file in the page cache as the round started (`mincore`).
    pub cached_before: f64,
    /// Whether `g` checked every qword this round (it found each right, or the run failed).
    pub checked: bool,
    /// The Firecracker process's minor page faults by the end of the `TOUCH` pass.
    pub vmm_minor_faults: u64,
    /// Its major page faults (read from disk).
    pub vmm_major_faults: u64,
    /// Bytes of its large mappings (guest memory) transparent huge pages mapped at the
    /// `TOUCH` line (smaps `AnonHugePages`).
    #[serde(default)]
    pub huge_at_touch: u64,
    /// The same once guestmem's server had collapsed it (its variants with the collapse on;
    /// read just before the resident pass, which waits for it), or just before that pass.
    #[serde(default)]
    pub huge_before_resident: u64,
    /// guestmem's page server's report (its variants only).
    pub server: Option<ServerSample>,
}

/// One variant in one cache state.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FcVariant {
    /// The variant's name.
    pub name: String,
    /// The page-cache state.
    pub cache: Cache,
    /// The guest's page size, bytes.
    pub page_size: u64,
    /// Load seconds over the measured rounds.
    pub load: Summary,
    /// First-full-touch seconds over the measured rounds.
    pub touch: Summary,
    /// Median load over `file`'s in the same cache state (0: no `file`).
    pub load_vs_file: f64,
    /// Median first full touch over `file`'s in the same cache state (0: no `file`).
    pub touch_vs_file: f64,
    /// The resident pass, seconds.
    #[serde(default)]
    pub resident: Summary,
    /// What the restore cost the guest: the first full touch less the resident pass of the
    /// same round, seconds.
    #[serde(default)]
    pub cost: Summary,
    /// Median cost over `file`'s in the same cache state (0: no `file`).
    #[serde(default)]
    pub cost_vs_file: f64,
    /// First full touch over `file`'s in the same round and cache state, one ratio per
    /// measured round (rounds side by side share the host's speed of the moment).
    #[serde(default)]
    pub touch_vs_file_paired: Summary,
    /// Every round, warm-ups included, in run order.
    pub samples: Vec<Sampled<FcSample>>,
}

/// What the scenario found (the result's body).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FirecrackerFindings {
    /// Why nothing was measured, if it was not.
    pub skipped: Option<String>,
    /// Variants left out, each with its reason.
    pub left_out: Vec<String>,
    /// Variant by cache state, in report order.
    pub variants: Vec<FcVariant>,
}

/// The scenario's whole result.
pub type FirecrackerResult = LabResult<FirecrackerLabConfig, FirecrackerFindings>;

fn err(what: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> LabError {
    LabError::restore(what)
}

/// An error of `what` (a variant, a boot) with its I/O cause.
fn failed(what: &str) -> impl Fn(io::Error) -> LabError + '_ {
    move |e| err(format!("{SCENARIO} {what}: {e}"))
}

/// A snapshot: its VM state and memory files.
struct Snap {
    vmstate: PathBuf,
    mem: PathBuf,
}

/// What every round needs.
struct Ctx<'a> {
    cfg: &'a FirecrackerLabConfig,
    fc: &'a Path,
    small: Option<Snap>,
    huge: Option<Snap>,
}

/// Runs the scenario; writes nothing but its scratch files (removed afterwards). Without
/// what it needs it returns a result that says why, rather than an error.
pub fn run_firecracker(cfg: &FirecrackerLabConfig) -> Result<FirecrackerResult, LabError> {
    cfg.protocol.validate(SCENARIO)?;
    let config = |reason: String| LabError::Config {
        scenario: SCENARIO,
        reason,
    };
    if let Some(bad) = cfg
        .only
        .iter()
        .find(|o| !Variant::ALL.iter().any(|v| v.name() == o.as_str()))
    {
        return Err(config(format!(
            "no variant {bad:?} (there are file, fc-on-demand, fc-fault-all, guestmem-4k, \
             guestmem-2m)"
        )));
    }
    if cfg.caches.is_empty() || cfg.mem_mib < GUEST_END_MIB || cfg.server_threads == 0 {
        return Err(config(format!(
            "caches must not be empty, memory at least {GUEST_END_MIB} MiB (the guest's \
             region ends there), server threads at least 1"
        )));
    }
    let run = RunInfo::collect(cfg.command.clone());
    let mut left_out = Vec::new();
    let (fc, variants) = match plan(cfg, &mut left_out) {
        Ok(p) => p,
        Err(why) => return Ok(result(cfg, run, Some(why), left_out, Vec::new())),
    };
    let variants = in_work_dir(&cfg.work_dir, || {
        measure_all(cfg, &fc, variants, &mut left_out)
    })?;
    let skipped = variants
        .is_empty()
        .then(|| "every variant was left out".to_string());
    Ok(result(cfg, run, skipped, left_out, variants))
}

/// The Firecracker binary and the variants that can run; or why none can.
fn plan(
    cfg: &FirecrackerLabConfig,
    left_out: &mut Vec<String>,
) -> Result<(PathBuf, Vec<Variant>), String> {
    let fc = cfg
        .firecracker
        .clone()
        .ok_or("no Firecracker binary given (--firecracker) or found in ../shared/firecracker")?;
    if !fc.is_file() {
        return Err(format!("no Firecracker binary at {}", fc.display()));
    }
    let dir = fc.parent().unwrap_or(Path::new("."));
    if !dir.join("guest.elf").is_file() {
        return Err(format!("no guest.elf beside {}", fc.display()));
    }
    if let Some(why) = vmm::host_unavailable() {
        return Err(why);
    }
    let mut variants = Vec::new();
    for v in Variant::ALL {
        if !cfg.only.is_empty() && !cfg.only.iter().any(|o| o == v.name()) {
            continue;
        }
        match v.handler().map(|h| dir.join(h)) {
            Some(h) if !h.is_file() => left_out.push(format!(
                "{}: no {} beside firecracker",
                v.name(),
                h.display()
            )),
            _ => variants.push(v),
        }
    }
    if variants.is_empty() {
        return Err("no variant left to run".into());
    }
    Ok((fc, variants))
}

/// Boots, snapshots and measures `variants` (the 2 MiB one left out if the pool cannot be
/// had); the pool is given back on return.
fn measure_all(
    cfg: &FirecrackerLabConfig,
    fc: &Path,
    mut variants: Vec<Variant>,
    left_out: &mut Vec<String>,
) -> Result<Vec<FcVariant>, LabError> {
    let mut _pool = None;
    if variants.iter().any(|v| v.huge()) {
        // The booted VM and one restored VM at a time.
        match HugePool2M::grow(2 * cfg.mem_mib.div_ceil(2)) {
            Ok(p) => _pool = Some(p),
            Err(why) => {
                left_out.push(format!("guestmem-2m: {why}"));
                variants.retain(|v| !v.huge());
            }
        }
    }
    if variants.is_empty() {
        return Ok(Vec::new());
    }
    let guest = fc.parent().unwrap_or(Path::new(".")).join("guest.elf");
    let small = variants.iter().any(|v| !v.huge());
    let huge = variants.iter().any(|v| v.huge());
    let (small, huge) = snapshots(cfg, fc, &guest, small, huge)?;
    let ctx = Ctx {
        cfg,
        fc,
        small,
        huge,
    };
    let combos: Vec<(Variant, Cache)> = variants
        .iter()
        .flat_map(|&v| cfg.caches.iter().map(move |&c| (v, c)))
        .collect();
    let last = cfg.protocol.warmup + cfg.protocol.rounds;
    let mut done = vec![0; combos.len()];
    let mut k = 0;
    let samples = cfg.protocol.run(combos.len(), |i| {
        done[i] += 1;
        k += 1;
        measure(&ctx, combos[i], done[i] == last, k)
    })?;
    Ok(summarise_variants(&combos, samples))
}

/// Boots the guest in 4 KiB pages (`small`) and in 2 MiB pages (`huge`) at once, waits for
/// both to fill, snapshots each and ends them.
fn snapshots(
    cfg: &FirecrackerLabConfig,
    fc: &Path,
    guest: &Path,
    small: bool,
    huge: bool,
) -> Result<(Option<Snap>, Option<Snap>), LabError> {
    let kinds: Vec<(bool, &str)> = [(false, "4k"), (true, "2m")]
        .into_iter()
        .filter(|&(h, _)| if h { huge } else { small })
        .collect();
    let mut vms = Vec::new();
    for &(h, name) in &kinds {
        let what = format!("boot ({name})");
        let vm = Vmm::start(fc, &cfg.work_dir, &format!("boot-{name}")).map_err(failed(&what))?;
        vm.boot(guest, cfg.mem_mib, h).map_err(failed(&what))?;
        vms.push(vm);
    }
    let mut snaps = (None, None);
    for (vm, &(h, name)) in vms.iter().zip(&kinds) {
        let what = format!("boot ({name})");
        vm.line("READY", BOOT_LIMIT).map_err(failed(&what))?;
        let snap = Snap {
            vmstate: cfg.work_dir.join(format!("{name}.vmstate")),
            mem: cfg.work_dir.join(format!("{name}.mem")),
        };
        vm.snapshot(&snap.vmstate, &snap.mem)
            .map_err(failed(&what))?;
        if h {
            snaps.1 = Some(snap);
        } else {
            snaps.0 = Some(snap);
        }
    }
    Ok(snaps)
}

/// Each variant's summaries, with its ratios to `file` in the same cache state.
fn summarise_variants(
    combos: &[(Variant, Cache)],
    samples: Vec<Vec<Sampled<FcSample>>>,
) -> Vec<FcVariant> {
    let mut out: Vec<FcVariant> = combos
        .iter()
        .zip(samples)
        .map(|(&(v, cache), samples)| FcVariant {
            name: v.name().into(),
            cache,
            page_size: if v.huge() { 2 << 20 } else { 4 << 10 },
            load: summarise(&samples, |s| s.load_secs),
            touch: summarise(&samples, |s| s.touch_secs),
            load_vs_file: 0.0,
            touch_vs_file: 0.0,
            resident: summarise(&samples, |s| s.resident_secs),
            cost: summarise(&samples, |s| s.touch_secs - s.resident_secs),
            cost_vs_file: 0.0,
            touch_vs_file_paired: Summary::default(),
            samples,
        })
        .collect();
    for i in 0..out.len() {
        let Some(file) = out
            .iter()
            .find(|f| f.name == Variant::File.name() && f.cache == out[i].cache)
        else {
            continue;
        };
        let (load, touch, cost) = (file.load.median, file.touch.median, file.cost.median);
        let paired = paired_ratios(&out[i].samples, &file.samples);
        let v = &mut out[i];
        v.load_vs_file = ratio(v.load.median, load);
        v.touch_vs_file = ratio(v.touch.median, touch);
        v.cost_vs_file = ratio(v.cost.median, cost);
        if !paired.is_empty() {
            v.touch_vs_file_paired = Summary::of(&paired);
        }
    }
    out
}

/// First full touch over `file`'s, round by round (measured rounds both have).
fn paired_ratios(v: &[Sampled<FcSample>], file: &[Sampled<FcSample>]) -> Vec<f64> {
    v.iter()
        .filter(|s| !s.at.warmup)
        .filter_map(|s| {
            let f = file.iter().find(|f| f.at.round == s.at.round)?;
            Some(ratio(s.sample.touch_secs, f.sample.touch_secs))
        })
        .collect()
}

/// The result frame around what was found.
fn result(
    cfg: &FirecrackerLabConfig,
    run: RunInfo,
    skipped: Option<String>,
    left_out: Vec<String>,
    variants: Vec<FcVariant>,
) -> FirecrackerResult {
    LabResult {
        scenario: SCENARIO.into(),
        seeds: Vec::new(),
        run,
        settings: FirecrackerLabConfig {
            thp_mode: thp_mode(),
            ..cfg.clone()
        },
        timed: "load: from sending snapshot/load to its reply; first full touch: from sending \
                snapshot/load to the guest's TOUCH line (t sent when the load returned), in a \
                fresh Firecracker process each round; resident pass: the same t pass sent again \
                right after (once guestmem's collapse to huge pages has ended); restore cost: \
                the first less the second"
            .into(),
        body: FirecrackerFindings {
            skipped,
            left_out,
            variants,
        },
    }
}
