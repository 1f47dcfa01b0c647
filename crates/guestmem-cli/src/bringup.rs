//! `guestmem bringup`: map a layout, bring it up, verify, report.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Result;
use clap::{Args as ClapArgs, ValueEnum};
use guestmem::bringup::{bringup_specs, BringupConfig, BringupReport, PinPolicy, Verify};
use guestmem::host::Host;
use guestmem::jobs::Numa;
use guestmem::plan::{self, EvenLayout};
use guestmem::populate::{Method, PinStrategy, PopulateConfig};
use guestmem::{Guard, GuestAddress, RegionSpec, Thp};

use crate::report;

/// Default guest memory: 4 GiB, or a quarter of what the host has available if less.
const DEFAULT_SIZE_BYTES: u64 = 4 << 30;
const DEFAULT_REGIONS: u64 = 4;
const TWO_MIB: u64 = 2 << 20;

#[derive(Clone, Copy, ValueEnum)]
enum OnOff {
    On,
    Off,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Pin {
    /// Pin up front when the locked-memory limit allows it, else do not pin.
    Auto,
    /// Do not pin.
    None,
    /// `mlock2(MLOCK_ONFAULT)` every region once, then populate.
    UpFront,
    /// Each worker locks its own chunk (the naive way).
    PerChunk,
}

#[derive(Clone, Copy, ValueEnum)]
enum MethodArg {
    /// `MADV_POPULATE_WRITE`.
    PopulateWrite,
    /// One write per page (for kernels without `MADV_POPULATE_WRITE`).
    Touch,
}

/// Flags of `guestmem bringup`.
#[derive(ClapArgs)]
pub struct Args {
    /// Total guest memory (e.g. 512M, 16G) [default: 4G, or a quarter of MemAvailable].
    #[arg(long, value_parser = parse_size, conflicts_with = "layout")]
    size: Option<u64>,
    /// Number of regions to split it into.
    #[arg(long, default_value_t = DEFAULT_REGIONS, conflicts_with = "layout")]
    regions: u64,
    /// A JSON layout file: [{"addr": "0", "size": "2G", "backing": "memfd", ...}, ...].
    #[arg(long)]
    layout: Option<PathBuf>,
    /// Backing: anon, memfd, hugetlb-2M, hugetlb-1G or file:PATH[@OFFSET].
    #[arg(long, default_value = "anon", conflicts_with = "layout")]
    backing: String,
    /// THP advice (MADV_HUGEPAGE) before populating.
    #[arg(long, value_enum, default_value = "on", conflicts_with = "layout")]
    thp: OnOff,
    /// Guard pages around each region.
    #[arg(long, value_enum, default_value = "on", conflicts_with = "layout")]
    guard: OnOff,
    /// Threads, the calling thread included [default: all CPUs, at most 16].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    threads: Option<u32>,
    /// How pages are faulted in.
    #[arg(long, value_enum, default_value = "populate-write")]
    method: MethodArg,
    /// How memory is pinned.
    #[arg(long, value_enum, default_value = "auto")]
    pin: Pin,
    /// Smallest chunk a thread takes (e.g. 64M).
    #[arg(long, value_parser = parse_size)]
    min_chunk: Option<u64>,
    /// Run each worker on the NUMA node of the memory it populates.
    #[arg(long)]
    numa: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

fn parse_size(s: &str) -> Result<u64, String> {
    plan::parse_size(s).map_err(|e| e.to_string())
}

fn default_size(regions: u64, host: &Host) -> u64 {
    let quarter = host.mem_available.map_or(DEFAULT_SIZE_BYTES, |a| a / 4);
    let unit = regions.max(1) * TWO_MIB;
    (DEFAULT_SIZE_BYTES.min(quarter) / unit * unit).max(unit)
}

fn specs(args: &Args, host: &Host) -> Result<Vec<RegionSpec>> {
    if let Some(path) = &args.layout {
        return Ok(plan::read_layout_file(path)?);
    }
    let layout = EvenLayout {
        size: args
            .size
            .unwrap_or_else(|| default_size(args.regions, host)),
        regions: args.regions,
        base: GuestAddress(0),
        backing: plan::parse_backing(&args.backing)?,
        thp: match args.thp {
            OnOff::On => Thp::Huge,
            OnOff::Off => Thp::NoHuge,
        },
        guard: match args.guard {
            OnOff::On => Guard::On,
            OnOff::Off => Guard::Off,
        },
    };
    Ok(layout.specs()?)
}

/// The region layout as the report shows it.
#[derive(serde::Serialize)]
struct RegionRow {
    guest_addr: u64,
    size: u64,
    backing: String,
    host_addr: u64,
    huge_align: u64,
}

#[derive(serde::Serialize)]
struct Output<'a> {
    layout: Vec<RegionRow>,
    report: &'a BringupReport,
}

/// Runs `guestmem bringup`: parse, call the library, print.
pub fn run(args: Args) -> Result<()> {
    let host = Host::read();
    let specs = specs(&args, &host)?;
    let total: u64 = specs.iter().map(|s| s.size()).sum();
    let (bar, progress) = report::progress(total, args.quiet || args.json);
    let mut populate = PopulateConfig {
        method: match args.method {
            MethodArg::PopulateWrite => Method::PopulateWrite,
            MethodArg::Touch => Method::Touch,
        },
        pin: match args.pin {
            Pin::None => PinStrategy::None,
            Pin::Auto | Pin::UpFront => PinStrategy::UpFront,
            Pin::PerChunk => PinStrategy::PerChunk,
        },
        numa: if args.numa {
            Numa::Affine
        } else {
            Numa::Ignore
        },
        progress,
        ..PopulateConfig::default()
    };
    if let Some(t) = args.threads {
        populate.threads = t as usize;
    }
    if let Some(c) = args.min_chunk {
        populate.min_chunk = c;
    }
    let cfg = BringupConfig {
        populate,
        pin_policy: match args.pin {
            Pin::Auto => PinPolicy::IfAllowed,
            _ => PinPolicy::Required,
        },
        verify: Verify::On,
    };
    let result = bringup_specs(&specs, &cfg);
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    let (map, report) = result?;
    let snap = map.view();
    let out = Output {
        layout: snap
            .regions()
            .iter()
            .map(|r| RegionRow {
                guest_addr: r.guest_addr().0,
                size: r.size(),
                backing: r.backing().name(),
                host_addr: r.host_addr() as u64,
                huge_align: r.huge_align(),
            })
            .collect(),
        report: &report,
    };
    let mut stdout = std::io::stdout().lock();
    if args.json {
        crate::report::write_json(&mut stdout, &out)?;
    } else {
        print_human(&mut stdout, &out)?;
    }
    Ok(())
}

fn print_human(w: &mut impl Write, out: &Output<'_>) -> std::io::Result<()> {
    let r = out.report;
    writeln!(
        w,
        "guestmem bringup: {} in {} regions, {} threads, chunk {}, {} chunks, method {:?}, pin {:?}",
        report::bytes(r.bytes),
        r.regions,
        r.threads,
        report::bytes(r.chunk_bytes),
        r.chunks,
        r.method,
        r.pin
    )?;
    for row in &out.layout {
        writeln!(
            w,
            "  region {:#014x} {:>10} {:<12} host {:#x}",
            row.guest_addr,
            report::bytes(row.size),
            row.backing,
            row.host_addr
        )?;
    }
    writeln!(w, "phases:")?;
    for p in &r.phases {
        writeln!(w, "  {:<9} {:>9.4} s", p.name, p.seconds)?;
    }
    writeln!(w, "rate:     {:.2} GB/s (lock + populate)", r.populate_gbps)?;
    let span: u64 = r.usage.iter().map(|u| u.huge_span).sum();
    let huge: u64 = r.usage.iter().map(|u| u.huge).sum();
    let resident: u64 = r.usage.iter().map(|u| u.resident).sum();
    let locked: u64 = r.usage.iter().map(|u| u.locked).sum();
    if span > 0 {
        writeln!(
            w,
            "huge:     {} of {} aligned span ({:.1}%)",
            report::bytes(huge),
            report::bytes(span),
            100.0 * huge as f64 / span as f64
        )?;
    }
    writeln!(w, "resident: {}", report::bytes(resident))?;
    writeln!(w, "locked:   {}", report::bytes(locked))?;
    let mut nodes = std::collections::BTreeMap::new();
    for u in &r.usage {
        for (n, b) in &u.numa {
            *nodes.entry(*n).or_insert(0u64) += b;
        }
    }
    if !nodes.is_empty() {
        let s: Vec<String> = nodes
            .iter()
            .map(|(n, b)| format!("node{n} {}", report::bytes(*b)))
            .collect();
        writeln!(w, "numa:     {}", s.join(", "))?;
    }
    if let Some(n) = &r.pin_note {
        writeln!(w, "note:     {n}")?;
    }
    for warning in &r.warnings {
        writeln!(w, "warning:  {warning}")?;
    }
    Ok(())
}
