//! How a result is kept and shown: one frame for every scenario's result ([`LabResult`]),
//! the Markdown report, and the run folder holding it beside the JSON. Every scenario's
//! result is a `LabResult` of its own settings and findings and implements [`LabReport`];
//! [`write_run`] and [`header`] are shared, so every report carries the same metadata
//! (command, commit, kernel, CPU, THP, protocol).

use std::path::{Path, PathBuf};

use crate::error::LabError;
use crate::plot::{write_svg, BarGroup};
use crate::run::{run_folder, Protocol, RunInfo};

/// A scenario's whole result, as written to `result.json`: the same frame for every
/// scenario, with its settings `S` and its findings `B` (whose fields, such as `variants`,
/// appear at the top level of the JSON beside the frame's).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LabResult<S, B> {
    /// The scenario's name: the run folder's suffix and the CLI subcommand.
    pub scenario: String,
    /// The seeds it reproduces.
    pub seeds: Vec<String>,
    /// Machine and command.
    pub run: RunInfo,
    /// Settings it was measured with.
    pub settings: S,
    /// What the timed seconds cover.
    pub timed: String,
    /// What it found.
    #[serde(flatten)]
    pub body: B,
}

/// How a scenario's [`LabResult`] is shown.
pub trait LabReport {
    /// The Markdown report.
    fn markdown(&self) -> String;
    /// What the plot shows: its axis unit and bar groups (none: no plot is drawn).
    fn bars(&self) -> (&'static str, Vec<BarGroup>) {
        ("", Vec::new())
    }
}

/// The report's first lines: a title, then one line of metadata (command, commit, kernel,
/// CPU, THP mode, protocol), then `settings`.
pub fn header(title: &str, run: &RunInfo, thp_mode: &str, p: &Protocol, settings: &str) -> String {
    format!(
        "# {title}\n\n{} | THP {} | {} warm-up + {} rounds, interleaved ({:?} order)\n\n\
         {settings}\n",
        run_line(run),
        thp_mode,
        p.warmup,
        p.rounds,
        p.order,
    )
}

/// What every report's head says of the run: the command, commit, kernel and CPU.
pub fn run_line(run: &RunInfo) -> String {
    format!(
        "`{}` | commit {}{} | {} | {} ({} CPUs)",
        run.command,
        run.git_commit.as_deref().unwrap_or("unknown"),
        if run.git_dirty == Some(true) {
            " (dirty)"
        } else {
            ""
        },
        run.kernel,
        run.cpu_model,
        run.cpus,
    )
}

/// Bytes as MiB with one decimal (tables quote coverage in MiB).
pub fn mib(b: u64) -> String {
    format!("{:.1}", b as f64 / f64::from(1u32 << 20))
}

/// Region sizes as `2G + 1G + 3 x 64M`: runs of equal sizes are counted, not repeated.
pub(crate) fn sizes_label(sizes: &[u64]) -> String {
    runs_label(sizes, " + ", gib)
}

/// `items` joined by `sep`, each run of equal items written once as `N x item`.
pub(crate) fn runs_label<T: PartialEq + Copy>(
    items: &[T],
    sep: &str,
    show: impl Fn(T) -> String,
) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < items.len() {
        let run = items[i..].iter().take_while(|&&x| x == items[i]).count();
        parts.push(if run > 1 {
            format!("{run} x {}", show(items[i]))
        } else {
            show(items[i])
        });
        i += run;
    }
    parts.join(sep)
}

fn gib(b: u64) -> String {
    match b {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{}G", b >> 30),
        b => format!("{}M", b >> 20),
    }
}

/// Writes `result.json` and `report.md` into a new `<base>/<timestamp>-<scenario>/` folder
/// and returns the folder.
pub fn write_run<S, B>(result: &LabResult<S, B>, base: &Path) -> Result<PathBuf, LabError>
where
    S: serde::Serialize,
    B: serde::Serialize,
    LabResult<S, B>: LabReport,
{
    let werr = |path: &Path| {
        let path = path.to_path_buf();
        move |source| LabError::Write { path, source }
    };
    let dir = run_folder(base, &result.run, &result.scenario).map_err(werr(base))?;
    let json = serde_json::to_string_pretty(result).expect("the result serialises");
    let p = dir.join("result.json");
    std::fs::write(&p, json + "\n").map_err(werr(&p))?;
    let p = dir.join("report.md");
    std::fs::write(&p, result.markdown()).map_err(werr(&p))?;
    let (unit, groups) = result.bars();
    if !groups.is_empty() {
        write_svg(&dir.join("plot.svg"), &result.scenario, unit, &groups)?;
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_label_counts_runs() {
        assert_eq!(
            sizes_label(&[2 << 30, 1 << 30, 64 << 20, 64 << 20, 64 << 20]),
            "2G + 1G + 3 x 64M"
        );
    }
}
