//! Every scenario in one run folder, with an `index.md` that strings their reports together:
//! what `guestmem-lab all` runs and what BENCHMARKS.md's committed run came from. The
//! profiles live here (each scenario's full settings, or `--quick`'s tiny ones), so the
//! command only parses and prints.

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::faults::{run_faults, FaultsLabConfig};
use crate::firecracker::{run_firecracker, FirecrackerLabConfig};
use crate::fleet::{run_fleet, FleetLabConfig};
use crate::guards::{run_guards, GuardsLabConfig};
use crate::huge_regain::{run_huge_regain, HugeRegainLabConfig};
use crate::populate::{run_populate, LayoutKind, PopulateLabConfig};
use crate::report::{run_line, write_run, LabReport, LabResult};
use crate::restore::{run_restore, RestoreLabConfig};
use crate::run::{run_folder, Order, Protocol, RunInfo};
use crate::translate::{run_translate, TranslateLabConfig};
use crate::vm_restore::{run_vm_restore, VmRestoreLabConfig};
use crate::LabError;

/// How much each scenario measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    /// Each scenario's own defaults, every layout: the measurement BENCHMARKS.md quotes.
    Full,
    /// Tiny sizes and one round: a check that every scenario runs, not a measurement.
    Quick,
}

/// What `run_all` does.
#[derive(Debug, Clone)]
pub struct AllConfig {
    /// The folder the run folder goes in.
    pub out: PathBuf,
    /// How much to measure.
    pub profile: Profile,
    /// The command line, recorded in every result.
    pub command: String,
}

/// What a run of every scenario gave.
#[derive(Debug, Clone)]
pub struct AllReport {
    /// The run folder (each scenario's folder inside it, and `index.md`).
    pub dir: PathBuf,
    /// The index, as written to `index.md`.
    pub index: String,
    /// Scenarios that could not run (each named in the index with its reason).
    pub failed: usize,
    /// Scenarios in all.
    pub total: usize,
}

/// One scenario: its name and what runs it into a folder (its run folder and report).
type Step = (
    &'static str,
    fn(&Path, &str, Profile) -> Result<(PathBuf, String), LabError>,
);

/// The scenarios, in the order they run.
const STEPS: [Step; 9] = [
    ("populate", populate),
    ("guards", guards),
    ("faults", faults),
    ("translate", translate),
    ("restore", restore),
    ("vm-restore", vm_restore),
    ("fleet", fleet),
    ("huge-regain", huge_regain),
    ("firecracker", firecracker),
];

/// One round, no warm-up: the quick profile's protocol.
const ONE_ROUND: Protocol = Protocol {
    warmup: 0,
    rounds: 1,
    order: Order::Rotate,
};

fn written<S, B>(result: LabResult<S, B>, base: &Path) -> Result<(PathBuf, String), LabError>
where
    S: serde::Serialize,
    B: serde::Serialize,
    LabResult<S, B>: LabReport,
{
    let dir = write_run(&result, base)?;
    Ok((dir, result.markdown()))
}

fn populate(base: &Path, cmd: &str, p: Profile) -> Result<(PathBuf, String), LabError> {
    let d = PopulateLabConfig::default();
    let cfg = match p {
        Profile::Quick => PopulateLabConfig {
            size: 256 << 20,
            layouts: vec![LayoutKind::Single],
            protocol: ONE_ROUND,
            command: cmd.into(),
            ..d
        },
        Profile::Full => PopulateLabConfig {
            layouts: vec![LayoutKind::Single, LayoutKind::Unequal, LayoutKind::Dimms],
            command: cmd.into(),
            ..d
        },
    };
    written(run_populate(&cfg)?, base)
}

fn guards(base: &Path, cmd: &str, p: Profile) -> Result<(PathBuf, String), LabError> {
    let d = GuardsLabConfig::default();
    let q = p == Profile::Quick;
    let cfg = GuardsLabConfig {
        size: if q { 8 << 20 } else { d.size },
        protocol: if q { ONE_ROUND } else { d.protocol },
        command: cmd.into(),
        ..d
    };
    written(run_guards(&cfg)?, base)
}

fn faults(base: &Path, cmd: &str, p: Profile) -> Result<(PathBuf, String), LabError> {
    let d = FaultsLabConfig::default();
    let q = p == Profile::Quick;
    let cfg = FaultsLabConfig {
        size: if q { 16 << 20 } else { d.size },
        protocol: if q { ONE_ROUND } else { d.protocol },
        command: cmd.into(),
        ..d
    };
    written(run_faults(&cfg)?, base)
}

fn translate(base: &Path, cmd: &str, p: Profile) -> Result<(PathBuf, String), LabError> {
    let d = TranslateLabConfig::default();
    let cfg = match p {
        Profile::Quick => TranslateLabConfig {
            region_counts: vec![1, 8],
            lookups_per_thread: 1 << 12,
            protocol: ONE_ROUND,
            command: cmd.into(),
            ..d
        },
        Profile::Full => TranslateLabConfig {
            command: cmd.into(),
            ..d
        },
    };
    written(run_translate(&cfg)?, base)
}

fn restore(base: &Path, cmd: &str, p: Profile) -> Result<(PathBuf, String), LabError> {
    let d = RestoreLabConfig::default();
    let q = p == Profile::Quick;
    let cfg = RestoreLabConfig {
        sizes: if q { vec![8 << 20] } else { d.sizes.clone() },
        protocol: if q { ONE_ROUND } else { d.protocol },
        command: cmd.into(),
        ..d
    };
    written(run_restore(&cfg)?, base)
}

fn vm_restore(base: &Path, cmd: &str, p: Profile) -> Result<(PathBuf, String), LabError> {
    let d = VmRestoreLabConfig::default();
    let q = p == Profile::Quick;
    let cfg = VmRestoreLabConfig {
        size: if q { 64 << 20 } else { d.size },
        protocol: if q { ONE_ROUND } else { d.protocol },
        command: cmd.into(),
        ..d
    };
    written(run_vm_restore(&cfg)?, base)
}

fn fleet(base: &Path, cmd: &str, p: Profile) -> Result<(PathBuf, String), LabError> {
    let d = FleetLabConfig::default();
    let q = p == Profile::Quick;
    let cfg = FleetLabConfig {
        vms: if q { 4 } else { d.vms },
        size: if q { 4 << 20 } else { d.size },
        protocol: if q { ONE_ROUND } else { d.protocol },
        command: cmd.into(),
        ..d
    };
    written(run_fleet(&cfg)?, base)
}

fn huge_regain(base: &Path, cmd: &str, p: Profile) -> Result<(PathBuf, String), LabError> {
    let d = HugeRegainLabConfig::default();
    let q = p == Profile::Quick;
    let cfg = HugeRegainLabConfig {
        size: if q { 16 << 20 } else { d.size },
        reads: if q { 1 << 16 } else { d.reads },
        protocol: if q { ONE_ROUND } else { d.protocol },
        command: cmd.into(),
        ..d
    };
    written(run_huge_regain(&cfg)?, base)
}

fn firecracker(base: &Path, cmd: &str, p: Profile) -> Result<(PathBuf, String), LabError> {
    if p == Profile::Quick {
        return Err(LabError::Config {
            scenario: crate::firecracker::SCENARIO,
            reason: "quick profile: Firecracker rounds take minutes (each boot fills 512 MiB \
                     for ~35 s on this emulating KVM)"
                .into(),
        });
    }
    let cfg = FirecrackerLabConfig {
        command: cmd.into(),
        ..FirecrackerLabConfig::default()
    };
    written(run_firecracker(&cfg)?, base)
}

/// The index's head: the command, commit, kernel and CPU, and what the profile means.
fn index_head(info: &RunInfo, profile: Profile) -> String {
    format!(
        "# guestmem-lab, every scenario\n\n{}{}\n\n",
        run_line(info),
        match profile {
            Profile::Quick => " | --quick: tiny sizes, one round: a check, not a measurement",
            Profile::Full => "",
        },
    )
}

/// One scenario's section of the index: its report (title one level down), its plot, its
/// folder and time; or why it did not run.
fn section(name: &str, base: &Path, ran: Result<(PathBuf, String), LabError>, secs: f64) -> String {
    match ran {
        Ok((dir, md)) => {
            let rel = dir.strip_prefix(base).unwrap_or(&dir).display().to_string();
            let mut s = md.replacen("# ", "## ", 1);
            if dir.join("plot.svg").exists() {
                s.push_str(&format!("\n![{name}]({rel}/plot.svg)\n"));
            }
            s.push_str(&format!(
                "\nRun folder: `{rel}/` (result.json holds every sample); took {secs:.0} s.\n\n"
            ));
            s
        }
        Err(e) => format!("## {name}\n\nNot measured: {}\n\n", chain(&e)),
    }
}

/// An error with its sources, `a: b: c`.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = c.source();
    }
    s
}

/// Runs every scenario into one run folder under `cfg.out` and writes its `index.md`. A
/// scenario that cannot run is named in the index with its reason; `progress` hears each
/// scenario's name as it starts.
pub fn run_all(cfg: &AllConfig, progress: &dyn Fn(&str)) -> Result<AllReport, LabError> {
    let info = RunInfo::collect(cfg.command.clone());
    let base = run_folder(&cfg.out, &info, "all").map_err(|source| LabError::Write {
        path: cfg.out.clone(),
        source,
    })?;
    let mut index = index_head(&info, cfg.profile);
    let mut failed = 0;
    for (name, step) in STEPS {
        progress(name);
        let t = Instant::now();
        let ran = step(&base, &cfg.command, cfg.profile);
        failed += usize::from(ran.is_err());
        index.push_str(&section(name, &base, ran, t.elapsed().as_secs_f64()));
    }
    let p = base.join("index.md");
    std::fs::write(&p, &index).map_err(|source| LabError::Write {
        path: p.clone(),
        source,
    })?;
    Ok(AllReport {
        dir: base,
        index,
        failed,
        total: STEPS.len(),
    })
}
