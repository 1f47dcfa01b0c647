//! `guestmem vm`: KVM's dirty_log_perf_test over a guestmem map.

use std::io::Write;

use anyhow::Result;
use clap::{Args as ClapArgs, ValueEnum};
use guestmem::plan;
use guestmem_lab::vm::guest::{GuestMode, Partition};
use guestmem_lab::vm::perf::{run as run_perf, PerfConfig, Prefault};

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

/// Flags of `guestmem vm`.
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
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
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

/// Runs `guestmem vm`.
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
        ..PerfConfig::default()
    };
    let report = run_perf(&config)?;
    let mut out = std::io::stdout().lock();
    if args.json {
        crate::report::write_json(&mut out, &report)?;
    } else {
        write!(out, "{report}")?;
    }
    Ok(())
}
