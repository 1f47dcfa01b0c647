//! `guestmem lab`: runs a lab scenario, writes its run folder, prints its Markdown table.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args as ClapArgs, Subcommand, ValueEnum};
use guestmem::plan::parse_size;
use guestmem_lab::populate::{
    run_populate, LayoutKind, Order, PopulateLabConfig, DEFAULT_ROUNDS, DEFAULT_SETTLE,
    DEFAULT_WARMUP_ROUNDS,
};
use guestmem_lab::report::write_run;

/// Where run folders go unless `--out` says otherwise.
const DEFAULT_OUT_DIR: &str = "lab-results";

/// Flags of `guestmem lab`.
#[derive(ClapArgs)]
pub struct Args {
    #[command(subcommand)]
    scenario: Scenario,
}

#[derive(Subcommand)]
enum Scenario {
    /// Seeds 000/001: bring up fresh memory with guestmem (1 and N threads, pinned) and the
    /// qemu-style and ch-style peers, interleaved; time and huge-page coverage.
    Populate(PopulateArgs),
}

#[derive(Clone, Copy, ValueEnum)]
enum LayoutArg {
    /// One region of the whole size.
    Single,
    /// 1/2 + 1/4 + 1/8 + 1/16 + 1/16 of the size.
    Unequal,
    /// Both, one after the other.
    Both,
}

#[derive(Clone, Copy, ValueEnum)]
enum OrderArg {
    /// A new fixed-seed shuffle each round, so predecessors vary.
    Shuffle,
    /// Each round starts one variant later (A B C, B C A, ...).
    Rotate,
    /// The same order every round (A B C, A B C, ...).
    Fixed,
}

/// Flags of `guestmem lab populate`.
#[derive(ClapArgs)]
pub struct PopulateArgs {
    /// Total guest memory of each layout (e.g. 4G).
    #[arg(long, default_value = "4G", value_parser = size)]
    size: u64,
    /// Measured rounds.
    #[arg(long, default_value_t = DEFAULT_ROUNDS)]
    rounds: usize,
    /// Warm-up rounds (recorded, not summarised).
    #[arg(long, default_value_t = DEFAULT_WARMUP_ROUNDS)]
    warmup: usize,
    /// Layouts to run.
    #[arg(long, value_enum, default_value = "both")]
    layout: LayoutArg,
    /// Pause after each variant unmaps, in milliseconds.
    #[arg(long, default_value_t = DEFAULT_SETTLE.as_millis() as u64)]
    settle_ms: u64,
    /// Order of the variants within a round.
    #[arg(long, value_enum, default_value = "shuffle")]
    order: OrderArg,
    /// Threads of the guestmem-N variants [default: all CPUs, at most 16].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    threads: Option<u32>,
    /// Folder the run folder is created in.
    #[arg(long, default_value = DEFAULT_OUT_DIR)]
    out: PathBuf,
}

fn size(s: &str) -> Result<u64, String> {
    parse_size(s).map_err(|e| e.to_string())
}

/// Runs `guestmem lab ...`.
pub fn run(args: Args) -> Result<()> {
    match args.scenario {
        Scenario::Populate(a) => populate(a),
    }
}

fn populate(a: PopulateArgs) -> Result<()> {
    let mut cfg = PopulateLabConfig {
        size: a.size,
        rounds: a.rounds,
        warmup: a.warmup,
        layouts: match a.layout {
            LayoutArg::Single => vec![LayoutKind::Single],
            LayoutArg::Unequal => vec![LayoutKind::Unequal],
            LayoutArg::Both => vec![LayoutKind::Single, LayoutKind::Unequal],
        },
        settle: Duration::from_millis(a.settle_ms),
        order: match a.order {
            OrderArg::Shuffle => Order::Shuffle,
            OrderArg::Rotate => Order::Rotate,
            OrderArg::Fixed => Order::Fixed,
        },
        command: std::env::args().collect::<Vec<_>>().join(" "),
        ..PopulateLabConfig::default()
    };
    if let Some(t) = a.threads {
        cfg.threads = t as usize;
    }
    let result = run_populate(&cfg).context("lab populate")?;
    let dir = write_run(&result, &a.out)?;
    let mut out = std::io::stdout().lock();
    write!(out, "{}", result.markdown())?;
    writeln!(out, "\nwritten to {}", dir.display())?;
    Ok(())
}
