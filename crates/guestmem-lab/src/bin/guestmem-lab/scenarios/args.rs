//! What `guestmem-lab SCENARIO` takes: each scenario's flags, and those every scenario
//! shares.

use std::path::PathBuf;

use clap::{Args as ClapArgs, Subcommand, ValueEnum};
use guestmem::plan::parse_size;
use guestmem_lab::populate::DEFAULT_SETTLE;
use guestmem_lab::run::{Order as RunOrder, Protocol};

/// Where run folders go unless `--out` says otherwise.
pub(super) const DEFAULT_OUT_DIR: &str = "lab-results";

/// The scenarios.
#[derive(Subcommand)]
pub enum Scenario {
    /// Seeds 000/001: bring up fresh memory with guestmem (1 and N threads, pinned) and the
    /// qemu-style and ch-style peers, interleaved; time and huge-page coverage.
    Populate(PopulateArgs),
    /// Seed 003: huge-page coverage and populate time of one region laid out by guestmem
    /// (with and without guards), TCG-style (a guard page inside) and unaligned.
    Guards(GuardsArgs),
    /// Seed 002: 4 KiB page faults from 1..=CPUs threads, in one VMA or one per thread, and
    /// MADV_POPULATE_WRITE per share; time, faults/s, scaling.
    Faults(FaultsArgs),
    /// Seed 004: lookups from several threads, each in its own regions: per-thread guestmem
    /// translators against a shared snapshot and vm-memory's find_region.
    Translate(TranslateArgs),
    /// Snapshot restore: guestmem's page server (Firecracker's handshake) with and without
    /// recorded prefetch, a Firecracker-style server, mapped and eager restores; reader
    /// threads stand in for vCPUs.
    Restore(RestoreArgs),
    /// A KVM guest saved and restored every way guestmem offers (eager, mapped, lazy with
    /// and without the recorded working set), beside the Firecracker-style peer and the
    /// plainest eager reader, until it has verified every page
    VmRestore(VmRestoreArgs),
    /// Many VMs restored at once from one snapshot: one guestmem fleet, a guestmem page
    /// server per VM, and Firecracker's example handler per VM.
    Fleet(FleetArgs),
    /// A VM's memory served straight from S3 (a real S3 server behind a proxy adding
    /// first-byte latency and a bandwidth cap): cold and warm frame caches, a recorded
    /// working set, many VMs at once; pushes and diffs.
    ObjectStore(ObjectStoreArgs),
    /// A map saved on transparent huge pages, restored onto 4 KiB pages, against the same
    /// restore collapsed back to huge pages: a random-access pass over each.
    HugeRegain(HugeRegainArgs),
    /// Restores of a real Firecracker VM: its File backend and example page handlers beside
    /// guestmem's page server, 4 KiB and 2 MiB guests, warm and cold page cache; every page
    /// checked by the guest.
    Firecracker(FirecrackerArgs),
    /// A running Firecracker VM moved between two page servers (two hosts on this one, a
    /// proxy adding round-trip latency): the pause and its steps, remote fetches, bytes
    /// sent against the diff, the window of risk; every qword checked after the move.
    Move(MoveArgs),
    /// Every scenario, one after the other, into one folder with an index.md of all reports.
    All(AllArgs),
}

/// Flags of `guestmem-lab restore`.
#[derive(ClapArgs)]
pub struct RestoreArgs {
    /// Image sizes, comma-separated [default: 256M,1G].
    #[arg(long, value_delimiter = ',', value_parser = size)]
    pub(super) sizes: Vec<u64>,
    /// Reader (vCPU) thread counts, comma-separated [default: 1 up to the CPUs].
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub(super) vcpus: Vec<u32>,
    /// Handler threads of the serve-uffd variants.
    #[arg(long, default_value_t = guestmem_lab::restore::DEFAULT_HANDLERS as u32, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub(super) handlers: u32,
    #[command(flatten)]
    pub(super) protocol: ProtocolArgs,
}

/// Flags of `guestmem-lab object-store`.
#[derive(ClapArgs)]
pub struct ObjectStoreArgs {
    /// The snapshot's size.
    #[arg(long, default_value = "1G", value_parser = size)]
    pub(super) size: u64,
    /// Frame size of the push.
    #[arg(long, default_value = "256K", value_parser = size)]
    pub(super) frame_size: u64,
    /// The page server's block for the local file (a snapshot in the store is served a
    /// frame a fault).
    #[arg(long, default_value = "1M", value_parser = size)]
    pub(super) block: u64,
    /// The working set's runs.
    #[arg(long, default_value = "256K", value_parser = size)]
    pub(super) ws_run: u64,
    /// First-byte latencies of the store, milliseconds, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "0,20")]
    pub(super) latency_ms: Vec<u64>,
    /// The link's bandwidth a second (0: no cap).
    #[arg(long, default_value = "1G", value_parser = size)]
    pub(super) bandwidth: u64,
    /// VMs of the many-VM variant.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub(super) vms: u32,
    /// Run only the variants whose names start so (file, file+ws, cold, warm, cold+ws,
    /// vms: `file` takes `file+ws` too, `cold` `cold+ws`), comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub(super) only: Vec<String>,
    /// The store's threads' nice value: 0 (the store competes for this host's CPUs with
    /// the page server and the VM), or 19 (it takes what they spare, as a store on other
    /// machines takes none of theirs; the move scenario's default).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true,
          value_parser = clap::value_parser!(i32).range(-20..=19))]
    pub(super) store_nice: i32,
    #[command(flatten)]
    pub(super) protocol: ProtocolArgs,
}

/// Flags of `guestmem-lab move`.
#[derive(ClapArgs)]
pub struct MoveArgs {
    /// What the guest writes before the move, MiB, comma-separated (each divides the
    /// region by a power of two).
    #[arg(long, value_delimiter = ',', default_value = "64,256")]
    pub(super) dirty_mib: Vec<u64>,
    /// Round trips added between the hosts, milliseconds, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "0,0.5,20")]
    pub(super) rtt_ms: Vec<f64>,
    /// Whether the destination fetches the source's frames ahead of the guest,
    /// comma-separated (`false`: every one through a fault, nothing prefetched).
    #[arg(long, value_delimiter = ',', default_value = "true,false")]
    pub(super) read_ahead: Vec<bool>,
    /// The guest's region, MiB (it starts at 64 MiB; filled at boot, checked after).
    #[arg(long, default_value_t = 512)]
    pub(super) region_mib: u64,
    /// The VM's memory, MiB.
    #[arg(long, default_value_t = 1024)]
    pub(super) mem_mib: u64,
    /// The Firecracker binary [default: ../shared/firecracker/firecracker].
    #[arg(long)]
    pub(super) firecracker: Option<PathBuf>,
    /// The store's threads' nice value: 19 leaves this host's CPUs to the two page servers
    /// and the guests, as a store on other machines would (0: the store competes for them).
    #[arg(long, default_value_t = 19, allow_negative_numbers = true,
          value_parser = clap::value_parser!(i32).range(-20..=19))]
    pub(super) store_nice: i32,
    #[command(flatten)]
    pub(super) protocol: ProtocolArgs,
}

/// Flags of `guestmem-lab fleet`.
#[derive(ClapArgs)]
pub struct FleetArgs {
    /// VMs restored at once.
    #[arg(long, default_value_t = guestmem_lab::fleet::DEFAULT_VMS as u32, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub(super) vms: u32,
    /// Memory per VM (a multiple of 1M).
    #[arg(long, default_value = "64M", value_parser = size)]
    pub(super) size: u64,
    /// Fault-serving threads: the fleet's pool, each once-server's handlers [default: the
    /// CPUs].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub(super) pool: Option<u32>,
    /// Firecracker's uffd_on_demand_handler [default: ../shared/firecracker's, if there].
    #[arg(long)]
    pub(super) fc_handler: Option<PathBuf>,
    /// Run only these variants (fleet, once-servers, fc-example), comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub(super) only: Vec<String>,
    #[command(flatten)]
    pub(super) protocol: ProtocolArgs,
}

/// Flags of `guestmem-lab firecracker`.
#[derive(ClapArgs)]
pub struct FirecrackerArgs {
    /// The Firecracker binary; guest.elf and the example handlers are taken from its folder
    /// [default: ../shared/firecracker/firecracker, if there; without one the scenario
    /// reports that it did not run].
    #[arg(long)]
    pub(super) firecracker: Option<PathBuf>,
    /// Run only these variants (file, fc-on-demand, fc-fault-all, guestmem-4k,
    /// guestmem-2m), comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub(super) only: Vec<String>,
    /// Page-cache states of the memory file to measure in, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "warm,cold")]
    pub(super) cache: Vec<CacheArg>,
    /// Handler threads of guestmem's page server [default: the CPUs, as serve-uffd].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub(super) threads: Option<u32>,
    #[command(flatten)]
    pub(super) protocol: ProtocolArgs,
}

#[derive(Clone, Copy, ValueEnum)]
pub(super) enum CacheArg {
    /// The memory file read whole before each round.
    Warm,
    /// The memory file dropped from the page cache before each round.
    Cold,
}

/// Flags of `guestmem-lab vm-restore`.
#[derive(ClapArgs)]
pub struct VmRestoreArgs {
    /// Guest memory (a multiple of 64M; 3G and more run the guest in long mode).
    #[arg(long, default_value = "1G", value_parser = size)]
    pub(super) size: u64,
    /// vCPUs.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub(super) vcpus: u32,
    #[command(flatten)]
    pub(super) protocol: ProtocolArgs,
}

/// Flags of `guestmem-lab all`.
#[derive(ClapArgs)]
pub struct AllArgs {
    /// Small sizes and one round each: checks every scenario end to end in seconds; its
    /// numbers are not measurements.
    #[arg(long)]
    pub(super) quick: bool,
    /// Folder the run folder is created in.
    #[arg(long, default_value = DEFAULT_OUT_DIR)]
    pub(super) out: PathBuf,
}

/// The protocol flags every scenario shares.
#[derive(ClapArgs)]
pub(super) struct ProtocolArgs {
    /// Measured rounds, at least 1 [default: the scenario's].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub(super) rounds: Option<u32>,
    /// Warm-up rounds, recorded, not summarised [default: the scenario's].
    #[arg(long)]
    pub(super) warmup: Option<usize>,
    /// Order of the variants within a round.
    #[arg(long, value_enum, default_value = "shuffle")]
    pub(super) order: OrderArg,
    /// Folder the run folder is created in.
    #[arg(long, default_value = DEFAULT_OUT_DIR)]
    pub(super) out: PathBuf,
}

impl ProtocolArgs {
    /// The protocol asked for, the scenario's `defaults` where a flag was not given.
    pub(super) fn protocol(&self, defaults: Protocol) -> Protocol {
        Protocol {
            warmup: self.warmup.unwrap_or(defaults.warmup),
            rounds: self.rounds.map_or(defaults.rounds, |r| r as usize),
            order: self.order.into(),
        }
    }
}

impl From<OrderArg> for RunOrder {
    fn from(o: OrderArg) -> RunOrder {
        match o {
            OrderArg::Shuffle => RunOrder::Shuffle,
            OrderArg::Rotate => RunOrder::Rotate,
            OrderArg::Fixed => RunOrder::Fixed,
        }
    }
}

/// Flags of `guestmem-lab faults`.
#[derive(ClapArgs)]
pub struct FaultsArgs {
    /// Total memory faulted per run, split evenly among the threads.
    #[arg(long, default_value = "1G", value_parser = size)]
    pub(super) size: u64,
    /// Thread counts, comma-separated [default: 1 up to the CPUs].
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub(super) threads: Vec<u32>,
    #[command(flatten)]
    pub(super) protocol: ProtocolArgs,
}

/// Flags of `guestmem-lab translate`.
#[derive(ClapArgs)]
pub struct TranslateArgs {
    /// Region counts, comma-separated [default: 1,8,64,512].
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u32).range(1..=32764))]
    pub(super) regions: Vec<u32>,
    /// Thread counts, comma-separated [default: 1 and the CPUs].
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub(super) threads: Vec<u32>,
    /// Lookups per thread per run (a multiple of 1024).
    #[arg(long, default_value_t = guestmem_lab::translate::DEFAULT_LOOKUPS_PER_THREAD)]
    pub(super) lookups: usize,
    /// Access patterns, comma-separated: own (a region at a time, as a vCPU), scattered
    /// (every lookup in a random region) [default: both].
    #[arg(long, value_delimiter = ',', value_enum)]
    pub(super) patterns: Vec<TranslatePattern>,
    #[command(flatten)]
    pub(super) protocol: ProtocolArgs,
}

/// `given` as usizes, or `default` when none were given.
pub(super) fn counts_or(given: &[u32], default: Vec<usize>) -> Vec<usize> {
    match given.is_empty() {
        true => default,
        false => given.iter().map(|&n| n as usize).collect(),
    }
}

/// Flags of `guestmem-lab guards`.
#[derive(ClapArgs)]
pub struct GuardsArgs {
    /// Region size (a multiple of 2 MiB, at least 4 MiB).
    #[arg(long, default_value = "64M", value_parser = size)]
    pub(super) size: u64,
    /// How far past a 2 MiB boundary the unaligned peer starts, in bytes.
    #[arg(long, default_value_t = guestmem_lab::guards::DEFAULT_UNALIGNED_SHIFT_BYTES)]
    pub(super) unaligned_shift: usize,
    #[command(flatten)]
    pub(super) protocol: ProtocolArgs,
}

/// Flags of `guestmem-lab huge-regain`.
#[derive(ClapArgs)]
pub struct HugeRegainArgs {
    /// Memory saved and restored (a multiple of 2 MiB).
    #[arg(long, default_value = "1G", value_parser = size)]
    pub(super) size: u64,
    /// Random 8-byte reads per pass.
    #[arg(long, default_value_t = guestmem_lab::huge_regain::DEFAULT_READS)]
    pub(super) reads: u64,
    #[command(flatten)]
    pub(super) protocol: ProtocolArgs,
}

#[derive(Clone, Copy, ValueEnum)]
pub(super) enum LayoutArg {
    /// One region of the whole size.
    Single,
    /// 1/2 + 1/4 + 1/8 + 1/16 + 1/16 of the size.
    Unequal,
    /// Both, one after the other.
    Both,
    /// Regions of 64 MiB each (a VM of memory DIMMs).
    Dimms,
    /// Single, unequal and dimms, one after the other.
    All,
}

#[derive(Clone, Copy, ValueEnum)]
pub(super) enum OrderArg {
    /// A new fixed-seed shuffle each round, so predecessors vary.
    Shuffle,
    /// Each round starts one variant later (A B C, B C A, ...).
    Rotate,
    /// The same order every round (A B C, A B C, ...).
    Fixed,
}

/// Flags of `guestmem-lab populate`.
#[derive(ClapArgs)]
pub struct PopulateArgs {
    /// Total guest memory of each layout (e.g. 4G).
    #[arg(long, default_value = "4G", value_parser = size)]
    pub(super) size: u64,
    /// Layouts to run.
    #[arg(long, value_enum, default_value = "all")]
    pub(super) layout: LayoutArg,
    /// Pause after each variant unmaps, in milliseconds.
    #[arg(long, default_value_t = DEFAULT_SETTLE.as_millis() as u64)]
    pub(super) settle_ms: u64,
    /// Threads of the guestmem-N variants [default: all CPUs, at most 16].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub(super) threads: Option<u32>,
    /// Also guestmem's other ways: the /proc/self/mem touch fallback, and pinning per chunk.
    #[arg(long)]
    pub(super) methods: bool,
    #[command(flatten)]
    pub(super) protocol: ProtocolArgs,
}

pub(super) fn size(s: &str) -> Result<u64, String> {
    parse_size(s).map_err(|e| e.to_string())
}

/// Where `lab translate`'s lookups go.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(super) enum TranslatePattern {
    /// A region at a time, as a vCPU touches its own memslot.
    Own,
    /// Every lookup in a pseudo-random region.
    Scattered,
}

impl From<&TranslatePattern> for guestmem_lab::translate::Pattern {
    fn from(p: &TranslatePattern) -> Self {
        match p {
            TranslatePattern::Own => guestmem_lab::translate::Pattern::Own,
            TranslatePattern::Scattered => guestmem_lab::translate::Pattern::Scattered,
        }
    }
}
