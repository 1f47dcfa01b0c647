//! `guestmem-lab vm`: KVM's dirty_log_perf_test over a guestmem map.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Result;
use clap::{Args as ClapArgs, ValueEnum};
use guestmem::plan;
use guestmem::restore::{Prefetch, RestoreMode};
use guestmem_lab::vm::guest::{GuestMode, Partition};
use guestmem_lab::vm::perf::{run as run_perf, PerfConfig, Prefault, RestoreRun};

#[derive(Clone, Copy, ValueEnum)]
enum Mode {
    /// Flat 32-bit protected mode, no paging: memory below 4 GiB.
    Protected32,
    /// 64-bit long mode with identity-mapped 2 MiB pages: memory below 64 GiB.
    Long64,
}

#[derive(Clone, Copy, ValueEnum)]
enum Share {
    /// Each vCPU one contiguous share of all memory, as dirty_log_perf_test does.
    Contiguous,
    /// Each vCPU a slice of every slot.
    PerSlot,
}

/// Flags of `guestmem-lab vm`.
#[derive(ClapArgs)]
pub struct Args {
    /// Guest data memory (e.g. 256M, 1G), split evenly over the slots.
    #[arg(long, default_value = "256M", value_parser = parse_size)]
    size: u64,
    /// vCPUs, one thread each.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=1024))]
    vcpus: u32,
    /// Data memslots.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    slots: u32,
    /// Dirty passes after the populate pass.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    passes: u32,
    /// Guest CPU mode.
    #[arg(long, value_enum, default_value = "protected32")]
    mode: Mode,
    /// How vCPUs share memory.
    #[arg(long, value_enum, default_value = "contiguous")]
    share: Share,
    /// How guest memory is faulted in before the guest's first pass: not at all (the guest's
    /// own touches, through KVM), by the host before the vCPUs start, or by the host in the
    /// background while they run.
    #[arg(long, value_enum, default_value = "none")]
    prefault: PrefaultArg,
    /// After the passes, save guest memory into this directory (a new one).
    #[arg(long, value_name = "DIR")]
    save: Option<PathBuf>,
    /// Start from the snapshot in this directory: the guest verifies every page it wrote
    /// before the save, then runs its passes. Size and slots come from the snapshot.
    #[arg(long, value_name = "DIR")]
    restore: Option<PathBuf>,
    /// How to restore.
    #[arg(long, value_enum, default_value = "lazy", requires = "restore")]
    restore_mode: RestoreModeArg,
    /// Lazy restore: threads serving faults.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=256), requires = "restore")]
    handler_threads: u32,
    /// Lazy restore: prefetch threads (0: one per CPU).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=256), requires = "restore")]
    prefetch_threads: u32,
    /// Lazy restore: prefetch the recorded working set first, then the rest (recorded), or
    /// nothing (none: only the guest's faults bring memory in).
    #[arg(long, value_enum, default_value = "recorded", requires = "restore")]
    prefetch: PrefetchArg,
    /// Lazy restore: write the order the guest faulted memory in into the snapshot's
    /// manifest, for the next restore to prefetch first (best with --prefetch none).
    #[arg(long, requires = "restore")]
    record: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, ValueEnum)]
enum RestoreModeArg {
    /// Populate memory and read the whole image into it, then start.
    Eager,
    /// Map the memory file privately (Firecracker's default): the kernel reads on touch.
    Mapped,
    /// userfaultfd: start at once, serve faults, prefetch in the background.
    Lazy,
    /// The Firecracker-style peer (lab): one thread, one 4 KiB UFFDIO_COPY per fault, no
    /// prefetch.
    FcPeer,
}

#[derive(Clone, Copy, ValueEnum)]
enum PrefetchArg {
    /// The recorded working set first, then everything else.
    Recorded,
    /// Nothing.
    None,
}

#[derive(Clone, Copy, ValueEnum)]
enum PrefaultArg {
    /// The guest faults its memory in itself.
    None,
    /// The host populates it all, then the vCPUs start.
    Blocking,
    /// The vCPUs start at once; the host populates behind them.
    Background,
}

fn parse_size(s: &str) -> Result<u64, String> {
    plan::parse_size(s).map_err(|e| e.to_string())
}

/// Runs `guestmem-lab vm`.
pub fn run(args: Args) -> Result<()> {
    let config = PerfConfig {
        memory_bytes: args.size,
        vcpus: args.vcpus as usize,
        slots: args.slots as usize,
        passes: args.passes as usize,
        partition: match args.share {
            Share::Contiguous => Partition::Contiguous,
            Share::PerSlot => Partition::PerSlot,
        },
        mode: match args.mode {
            Mode::Protected32 => GuestMode::Protected32,
            Mode::Long64 => GuestMode::Long64,
        },
        prefault: match args.prefault {
            PrefaultArg::None => Prefault::None,
            PrefaultArg::Blocking => Prefault::Blocking,
            PrefaultArg::Background => Prefault::Background,
        },
        restore: args.restore.map(|dir| RestoreRun {
            dir,
            mode: match args.restore_mode {
                RestoreModeArg::Eager => RestoreMode::Eager,
                RestoreModeArg::Mapped => RestoreMode::Mapped,
                RestoreModeArg::Lazy | RestoreModeArg::FcPeer => RestoreMode::Lazy,
            },
            fc_peer: matches!(args.restore_mode, RestoreModeArg::FcPeer),
            handler_threads: args.handler_threads as usize,
            prefetch_threads: args.prefetch_threads as usize,
            prefetch: match args.prefetch {
                PrefetchArg::Recorded => Prefetch::WorkingSet,
                PrefetchArg::None => Prefetch::None,
            },
            record: args.record,
        }),
        save: args.save,
        ..PerfConfig::default()
    };
    let report = run_perf(&config)?;
    let mut out = std::io::stdout().lock();
    if args.json {
        crate::write_json(&mut out, &report)?;
    } else {
        write!(out, "{report}")?;
    }
    Ok(())
}
