//! How a result is shown: the Markdown report, and the run folder holding it beside the JSON.
//! Every scenario's result implements [`LabReport`]; [`write_run`] and [`header`] are shared,
//! so every report carries the same metadata (command, commit, kernel, CPU, THP, protocol).

use std::path::{Path, PathBuf};

use crate::error::LabError;
use crate::plot::{write_svg, Bar, BarGroup};
use crate::populate::PopulateResult;
use crate::run::{run_folder, Protocol, RunInfo};

/// A scenario's whole result: what [`write_run`] writes.
pub trait LabReport: serde::Serialize {
    /// The scenario's name: the run folder's suffix and the CLI subcommand.
    fn scenario(&self) -> &str;
    /// The machine and command it came from.
    fn run_info(&self) -> &RunInfo;
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
        "# {title}\n\n`{}` | commit {}{} | {} | {} ({} CPUs) | THP {} | {} warm-up + {} rounds, \
         interleaved ({:?} order)\n\n{settings}\n",
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
        thp_mode,
        p.warmup,
        p.rounds,
        p.order,
    )
}

/// Bytes as MiB with one decimal (tables quote coverage in MiB).
pub fn mib(b: u64) -> String {
    format!("{:.1}", b as f64 / f64::from(1u32 << 20))
}

/// Region sizes as `2G + 1G + 3 x 64M`: runs of equal sizes are counted, not repeated.
fn sizes_label(sizes: &[u64]) -> String {
    runs_label(sizes, " + ", gib)
}

/// `items` joined by `sep`, each run of equal items written once as `N x item`.
fn runs_label<T: PartialEq + Copy>(items: &[T], sep: &str, show: impl Fn(T) -> String) -> String {
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

impl PopulateResult {
    /// The result as a Markdown report: settings, then one table per layout.
    pub fn markdown(&self) -> String {
        let mut md = String::new();
        let protocol = Protocol {
            warmup: self.settings.warmup,
            rounds: self.settings.rounds,
            order: self.settings.order,
        };
        md.push_str(&header(
            "populate (seeds 000/001)",
            &self.run,
            &self.settings.thp_mode,
            &protocol,
            &format!(
                "{:.1} s settle between variants.",
                self.settings.settle_seconds
            ),
        ));
        md.push_str(&format!("Timed: {}.\n", self.timed));
        for l in &self.layouts {
            md.push_str(&format!(
                "\n## {} ({})\n\n| variant | threads | median s | min s | max s | max/min \
                 | GB/s @median | time / guestmem-{n} | huge coverage | 2M-aligned maps |\n\
                 |---|---|---|---|---|---|---|---|---|---|\n",
                l.layout.name(),
                sizes_label(&l.region_sizes),
                n = self.settings.threads,
            ));
            for v in &l.variants {
                let last = v.samples.last();
                let threads = last.map_or(String::new(), |s| {
                    runs_label(&s.threads, "+", |t| t.to_string())
                });
                let aligned = last.map_or(String::new(), |s| {
                    format!("{}/{}", s.thp_aligned_mappings, s.mappings)
                });
                md.push_str(&format!(
                    "| {} | {} | {:.3} | {:.3} | {:.3} | {:.2} | {:.1} | {:.2} | {:.1}% | {} |\n",
                    v.name,
                    threads,
                    v.seconds.median,
                    v.seconds.min,
                    v.seconds.max,
                    if v.seconds.min > 0.0 {
                        v.seconds.max / v.seconds.min
                    } else {
                        0.0
                    },
                    v.gbps_at_median,
                    v.time_vs_guestmem_n,
                    v.huge_coverage_median * 100.0,
                    aligned,
                ));
            }
            md.push_str(&format!(
                "\nguestmem scaling, {} threads vs 1 (rate ratio of medians): {:.2}x\n",
                self.settings.threads, l.guestmem_scaling
            ));
        }
        md
    }
}

impl LabReport for PopulateResult {
    fn scenario(&self) -> &str {
        &self.scenario
    }

    fn run_info(&self) -> &RunInfo {
        &self.run
    }

    fn markdown(&self) -> String {
        PopulateResult::markdown(self)
    }

    fn bars(&self) -> (&'static str, Vec<BarGroup>) {
        let groups = self
            .layouts
            .iter()
            .map(|l| BarGroup {
                title: format!("{} ({})", l.layout.name(), sizes_label(&l.region_sizes)),
                bars: l
                    .variants
                    .iter()
                    .map(|v| Bar {
                        label: v.name.clone(),
                        median: v.seconds.median,
                        min: v.seconds.min,
                        max: v.seconds.max,
                    })
                    .collect(),
            })
            .collect();
        ("seconds (bar: median, line: min to max)", groups)
    }
}

/// Writes `result.json` and `report.md` into a new `<base>/<timestamp>-<scenario>/` folder
/// and returns the folder.
pub fn write_run<R: LabReport>(result: &R, base: &Path) -> Result<PathBuf, LabError> {
    let werr = |path: &Path| {
        let path = path.to_path_buf();
        move |source| LabError::Write { path, source }
    };
    let dir = run_folder(base, result.run_info(), result.scenario()).map_err(werr(base))?;
    let json = serde_json::to_string_pretty(result).expect("the result serialises");
    let p = dir.join("result.json");
    std::fs::write(&p, json + "\n").map_err(werr(&p))?;
    let p = dir.join("report.md");
    std::fs::write(&p, result.markdown()).map_err(werr(&p))?;
    let (unit, groups) = result.bars();
    if !groups.is_empty() {
        write_svg(&dir.join("plot.svg"), result.scenario(), unit, &groups)?;
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
