//! `guestmem inspect`: what the kernel gave a running process's large mappings (a VMM's
//! guest memory): residency, huge pages, locking, 2 MiB alignment.

use std::io::Write;

use anyhow::Result;
use clap::Args as ClapArgs;
use guestmem::inspect::inspect_process;
use guestmem::plan;

use crate::report;

/// Flags of `guestmem inspect`.
#[derive(ClapArgs)]
pub struct Args {
    /// The process to inspect (a running QEMU, Cloud Hypervisor, Firecracker...).
    #[arg(long)]
    pid: u32,
    /// Smallest mapping to list (e.g. 64M): guest RAM, not libraries.
    #[arg(long, default_value = "64M", value_parser = parse_size)]
    min_size: u64,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

fn parse_size(s: &str) -> Result<u64, String> {
    plan::parse_size(s).map_err(|e| e.to_string())
}

/// Runs `guestmem inspect`.
pub fn run(args: Args) -> Result<()> {
    let maps = inspect_process(Some(args.pid), args.min_size)?;
    let mut out = std::io::stdout().lock();
    if args.json {
        crate::report::write_json(&mut out, &maps)?;
        return Ok(());
    }
    writeln!(
        out,
        "{:<18} {:>11} {:>11} {:>11} {:>7} {:>11} {:>9}  name",
        "start", "size", "resident", "huge", "huge%", "locked", "off 2M"
    )?;
    for m in &maps {
        let pct = if m.huge_span > 0 {
            format!("{:.1}", 100.0 * m.huge as f64 / m.huge_span as f64)
        } else {
            "-".into()
        };
        writeln!(
            out,
            "{:<#18x} {:>11} {:>11} {:>11} {:>7} {:>11} {:>#9x}  {}",
            m.start,
            report::bytes(m.size),
            report::bytes(m.resident),
            report::bytes(m.huge),
            pct,
            report::bytes(m.locked),
            m.offset_2m,
            if m.name.is_empty() { "[anon]" } else { &m.name }
        )?;
    }
    if maps.is_empty() {
        writeln!(
            out,
            "no mapping of at least {} in process {}",
            report::bytes(args.min_size),
            args.pid
        )?;
    }
    Ok(())
}
