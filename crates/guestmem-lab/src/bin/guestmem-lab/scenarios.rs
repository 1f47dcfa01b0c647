//! `guestmem-lab SCENARIO`: runs a lab scenario, writes its run folder, prints its Markdown
//! table.

mod args;

use std::io::Write;
use std::time::Duration;

use anyhow::{Context, Result};
use guestmem_lab::all::{run_all, AllConfig, Profile};
use guestmem_lab::faults::{run_faults, FaultsLabConfig};
use guestmem_lab::firecracker::{run_firecracker, Cache, FirecrackerLabConfig};
use guestmem_lab::fleet::{run_fleet, FleetLabConfig};
use guestmem_lab::guards::{run_guards, GuardsLabConfig};
use guestmem_lab::huge_regain::{run_huge_regain, HugeRegainLabConfig};
use guestmem_lab::moves::{run_move, MoveLabConfig};
use guestmem_lab::object_store::{run_object_store, ObjectStoreLabConfig};
use guestmem_lab::populate::{run_populate, LayoutKind, PopulateLabConfig};
use guestmem_lab::report::{write_run, LabReport, LabResult};
use guestmem_lab::restore::{run_restore, RestoreLabConfig};
use guestmem_lab::run::prepare_out;
use guestmem_lab::translate::{run_translate, TranslateLabConfig};
use guestmem_lab::vm_restore::{run_vm_restore, VmRestoreLabConfig};

pub use args::Scenario;
use args::*;

/// Runs `guestmem-lab SCENARIO ...`.
pub fn run(scenario: Scenario) -> Result<()> {
    // The output folder is checked (and made) before anything is measured.
    let out = match &scenario {
        Scenario::Populate(a) => &a.protocol.out,
        Scenario::Guards(a) => &a.protocol.out,
        Scenario::Faults(a) => &a.protocol.out,
        Scenario::Translate(a) => &a.protocol.out,
        Scenario::Restore(a) => &a.protocol.out,
        Scenario::VmRestore(a) => &a.protocol.out,
        Scenario::Fleet(a) => &a.protocol.out,
        Scenario::ObjectStore(a) => &a.protocol.out,
        Scenario::Move(a) => &a.protocol.out,
        Scenario::HugeRegain(a) => &a.protocol.out,
        Scenario::Firecracker(a) => &a.protocol.out,
        Scenario::All(a) => &a.out,
    };
    prepare_out(out).with_context(|| format!("--out {}", out.display()))?;
    match scenario {
        Scenario::All(a) => all(a),
        Scenario::Restore(a) => {
            let d = RestoreLabConfig::default();
            let cfg = RestoreLabConfig {
                sizes: if a.sizes.is_empty() {
                    d.sizes.clone()
                } else {
                    a.sizes.clone()
                },
                vcpus: counts_or(&a.vcpus, d.vcpus.clone()),
                handlers: a.handlers as usize,
                protocol: a.protocol.protocol(d.protocol),
                command: command_line(),
                ..d
            };
            emit(&run_restore(&cfg).context("lab restore")?, &a.protocol.out)
        }
        Scenario::VmRestore(a) => {
            let d = VmRestoreLabConfig::default();
            let cfg = VmRestoreLabConfig {
                size: a.size,
                vcpus: a.vcpus as usize,
                protocol: a.protocol.protocol(d.protocol),
                command: command_line(),
                ..d
            };
            emit(
                &run_vm_restore(&cfg).context("lab vm-restore")?,
                &a.protocol.out,
            )
        }
        Scenario::Fleet(a) => {
            let d = FleetLabConfig::default();
            let cfg = FleetLabConfig {
                vms: a.vms as usize,
                size: a.size,
                pool: a.pool.map_or(d.pool, |p| p as usize),
                fc_handler: a.fc_handler.clone().or(d.fc_handler.clone()),
                only: a.only.clone(),
                protocol: a.protocol.protocol(d.protocol),
                command: command_line(),
                ..d
            };
            emit(&run_fleet(&cfg).context("lab fleet")?, &a.protocol.out)
        }
        Scenario::ObjectStore(a) => {
            let d = ObjectStoreLabConfig::default();
            let cfg = ObjectStoreLabConfig {
                size: a.size,
                frame_bytes: a.frame_size,
                block_bytes: a.block,
                ws_run: a.ws_run,
                latencies_ms: a.latency_ms.clone(),
                bandwidth: a.bandwidth,
                vms: a.vms as usize,
                only: a.only.clone(),
                store_nice: a.store_nice,
                protocol: a.protocol.protocol(d.protocol),
                command: command_line(),
                ..d
            };
            emit(
                &run_object_store(&cfg).context("lab object-store")?,
                &a.protocol.out,
            )
        }
        Scenario::Move(a) => {
            let d = MoveLabConfig::default();
            let cfg = MoveLabConfig {
                dirty_mib: a.dirty_mib.clone(),
                rtt_ms: a.rtt_ms.clone(),
                read_ahead: a.read_ahead.clone(),
                store_nice: a.store_nice,
                region_mib: a.region_mib,
                mem_mib: a.mem_mib,
                firecracker: a.firecracker.clone(),
                protocol: a.protocol.protocol(d.protocol),
                command: command_line(),
                ..d
            };
            emit(&run_move(&cfg).context("lab move")?, &a.protocol.out)
        }
        Scenario::Firecracker(a) => {
            let d = FirecrackerLabConfig::default();
            let cfg = FirecrackerLabConfig {
                firecracker: a.firecracker.clone().or(d.firecracker.clone()),
                only: a.only.clone(),
                caches: a
                    .cache
                    .iter()
                    .map(|c| match c {
                        CacheArg::Warm => Cache::Warm,
                        CacheArg::Cold => Cache::Cold,
                    })
                    .collect(),
                server_threads: a.threads.map_or(d.server_threads, |t| t as usize),
                protocol: a.protocol.protocol(d.protocol),
                command: command_line(),
                ..d
            };
            emit(
                &run_firecracker(&cfg).context("lab firecracker")?,
                &a.protocol.out,
            )
        }
        Scenario::Populate(a) => populate(a),
        Scenario::HugeRegain(a) => {
            let d = HugeRegainLabConfig::default();
            let cfg = HugeRegainLabConfig {
                size: a.size,
                reads: a.reads,
                protocol: a.protocol.protocol(d.protocol),
                command: command_line(),
                ..d
            };
            emit(
                &run_huge_regain(&cfg).context("lab huge-regain")?,
                &a.protocol.out,
            )
        }
        Scenario::Guards(a) => {
            let d = GuardsLabConfig::default();
            let cfg = GuardsLabConfig {
                size: a.size,
                protocol: a.protocol.protocol(d.protocol),
                unaligned_shift: a.unaligned_shift,
                command: command_line(),
            };
            emit(&run_guards(&cfg).context("lab guards")?, &a.protocol.out)
        }
        Scenario::Faults(a) => {
            let d = FaultsLabConfig::default();
            let cfg = FaultsLabConfig {
                size: a.size,
                threads: counts_or(&a.threads, d.threads),
                protocol: a.protocol.protocol(d.protocol),
                command: command_line(),
            };
            emit(&run_faults(&cfg).context("lab faults")?, &a.protocol.out)
        }
        Scenario::Translate(a) => {
            let d = TranslateLabConfig::default();
            let cfg = TranslateLabConfig {
                region_counts: counts_or(&a.regions, d.region_counts),
                threads: counts_or(&a.threads, d.threads),
                lookups_per_thread: a.lookups,
                patterns: if a.patterns.is_empty() {
                    d.patterns
                } else {
                    a.patterns.iter().map(|p| p.into()).collect()
                },
                protocol: a.protocol.protocol(d.protocol),
                command: command_line(),
            };
            emit(
                &run_translate(&cfg).context("lab translate")?,
                &a.protocol.out,
            )
        }
    }
}

/// `guestmem-lab all`: every scenario into one run folder, then its index.md.
fn all(a: AllArgs) -> Result<()> {
    let cfg = AllConfig {
        out: a.out.clone(),
        profile: if a.quick {
            Profile::Quick
        } else {
            Profile::Full
        },
        command: command_line(),
    };
    let report = run_all(&cfg, &|name| eprintln!("guestmem-lab all: {name} ..."))
        .with_context(|| format!("--out {}", a.out.display()))?;
    let mut out = std::io::stdout().lock();
    write!(out, "{}", report.index)?;
    writeln!(out, "\nwritten to {}", report.dir.display())?;
    if report.failed == report.total {
        anyhow::bail!("no scenario ran");
    }
    Ok(())
}

fn command_line() -> String {
    std::env::args().collect::<Vec<_>>().join(" ")
}

/// Writes the run folder and prints the report.
fn emit<S, B>(result: &LabResult<S, B>, out_dir: &std::path::Path) -> Result<()>
where
    S: serde::Serialize,
    B: serde::Serialize,
    LabResult<S, B>: LabReport,
{
    let dir = write_run(result, out_dir)?;
    let mut out = std::io::stdout().lock();
    write!(out, "{}", result.markdown())?;
    writeln!(out, "\nwritten to {}", dir.display())?;
    Ok(())
}

fn populate(a: PopulateArgs) -> Result<()> {
    let d = PopulateLabConfig::default();
    let mut cfg = PopulateLabConfig {
        size: a.size,
        protocol: a.protocol.protocol(d.protocol),
        layouts: match a.layout {
            LayoutArg::Single => vec![LayoutKind::Single],
            LayoutArg::Unequal => vec![LayoutKind::Unequal],
            LayoutArg::Both => vec![LayoutKind::Single, LayoutKind::Unequal],
            LayoutArg::Dimms => vec![LayoutKind::Dimms],
            LayoutArg::All => vec![LayoutKind::Single, LayoutKind::Unequal, LayoutKind::Dimms],
        },
        settle: Duration::from_millis(a.settle_ms),
        methods: a.methods,
        command: command_line(),
        ..d
    };
    if let Some(t) = a.threads {
        cfg.threads = t as usize;
    }
    emit(
        &run_populate(&cfg).context("lab populate")?,
        &a.protocol.out,
    )
}
