//! The firecracker scenario's Markdown report and plot.

use super::{Cache, FcSample, FcVariant, FirecrackerResult, ServerSample};
use crate::plot::{Bar, BarGroup};
use crate::report::{header, LabReport};
use crate::run::{summarise, Summary};

/// `median (min-max)` in seconds.
fn secs(s: &Summary) -> String {
    format!("{:.3} ({:.3}-{:.3})", s.median, s.min, s.max)
}

/// The median of a server phase over the measured rounds that have it, or `n/a`.
fn phase(v: &FcVariant, f: fn(&ServerSample) -> Option<f64>) -> String {
    let got: Vec<f64> = v
        .samples
        .iter()
        .filter(|s| !s.at.warmup)
        .filter_map(|s| s.sample.server.as_ref().and_then(f))
        .collect();
    match got.is_empty() {
        true => "n/a".into(),
        false => format!("{:.3}", Summary::of(&got).median),
    }
}

/// The last round's server counts, `faults / blocks in of blocks`, or `n/a`.
fn served(v: &FcVariant) -> String {
    v.samples
        .last()
        .and_then(|s| s.sample.server.as_ref())
        .map_or("n/a".into(), |s| {
            format!("{} / {} of {}", s.faults, s.fault_blocks, s.blocks)
        })
}

/// One table row.
fn row(v: &FcVariant) -> String {
    let m = |f: fn(&FcSample) -> f64| summarise(&v.samples, f).median;
    let ratio = |r: f64| match r > 0.0 {
        true => format!("{r:.2}"),
        false => "n/a".into(),
    };
    format!(
        "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.0}% | {:.0} / {:.0} | {} | {} | {} | {} | {:.0} | {:.0} | {} |\n",
        v.name,
        v.cache.name(),
        if v.page_size >= 2 << 20 { "2M" } else { "4K" },
        secs(&v.load),
        secs(&v.touch),
        ratio(v.load_vs_file),
        ratio(v.touch_vs_file),
        match v.touch_vs_file_paired.n {
            0 => "n/a".to_string(),
            _ => format!(
                "{:.2} ({:.2}-{:.2})",
                v.touch_vs_file_paired.median,
                v.touch_vs_file_paired.min,
                v.touch_vs_file_paired.max
            ),
        },
        secs(&v.resident),
        secs(&v.cost),
        ratio(v.cost_vs_file),
        m(|s| s.cached_before) * 100.0,
        m(|s| s.vmm_minor_faults as f64),
        m(|s| s.vmm_major_faults as f64),
        served(v),
        phase(v, |s| s.handshake_secs),
        phase(v, |s| s.first_fault_secs),
        phase(v, |s| s.all_in_secs),
        m(|s| s.huge_at_touch as f64) / f64::from(1 << 20),
        m(|s| s.huge_before_resident as f64) / f64::from(1 << 20),
        if v.samples.iter().any(|s| s.sample.checked) {
            "yes"
        } else {
            "no"
        },
    )
}

impl LabReport for FirecrackerResult {
    fn markdown(&self) -> String {
        let s = &self.settings;
        let fc = s
            .firecracker
            .as_ref()
            .map_or("none".to_string(), |p| format!("`{}`", p.display()));
        let mut md = header(
            "firecracker (restores of a real Firecracker VM)",
            &self.run,
            &s.thp_mode,
            &s.protocol,
            &format!(
                "Firecracker {fc}; the shared guest (512 MiB filled from 64 MiB) in a {} MiB VM, \
                 one vCPU; guestmem's server as `serve-uffd --once` runs it ({} handler \
                 threads, 1 MiB blocks, one prefetch thread; `-faults`: none). Timed: {}. Cache: the memory file read \
                 whole (warm) or written back and dropped with POSIX_FADV_DONTNEED (cold) \
                 before each round; `cached` is what mincore found then. Server phases are \
                 seconds after sending snapshot/load (medians). `touch / file, round by round`: \
                 each round's first full touch over `file`'s in the same round, median \
                 (min-max) of those ratios. `resident pass`: the same `t` pass sent again \
                 right after (for `guestmem-4k`, once its server's collapse to huge pages, \
                 which starts a second after all is in, has ended: a few seconds later, on \
                 huge pages), every page in: the guest's own work, which huge pages can \
                 shorten (on the AMD host they did not; on the Intel hosts of 2026-11-29 \
                 they halved it, so there `guestmem-4k`'s restore cost also counts a 4 KiB \
                 first touch against a huge-page pass); `restore cost`: first full touch \
                 less that pass, round by round. `huge MiB after`: AnonHugePages (or hugetlb) just \
                 before that pass. \
                 Every TOUCH said BAD 0; \
                 `checked`: a `g` pass also found every qword right.\n",
                s.mem_mib, s.server_threads, self.timed
            ),
        );
        if let Some(why) = &self.body.skipped {
            md.push_str(&format!("Not measured: {why}\n"));
        }
        for l in &self.body.left_out {
            md.push_str(&format!("\nLeft out: {l}\n"));
        }
        if self.body.variants.is_empty() {
            return md;
        }
        md.push_str(
            "\n| variant | cache | page | load s | first full touch s | load / file \
             | touch / file | touch / file, round by round | resident pass s | restore cost s \
             | cost / file | cached | VMM faults min / maj | server faults / blocks in \
             | handshake s | first fault s | all in s | huge MiB at touch | huge MiB after \
             | checked |\n\
             |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        );
        for v in &self.body.variants {
            md.push_str(&row(v));
        }
        md
    }

    fn bars(&self) -> (&'static str, Vec<BarGroup>) {
        let groups = [Cache::Warm, Cache::Cold]
            .into_iter()
            .map(|c| BarGroup {
                title: format!("{} page cache", c.name()),
                bars: self
                    .body
                    .variants
                    .iter()
                    .filter(|v| v.cache == c)
                    .map(|v| Bar::of(&v.name, &v.touch))
                    .collect(),
            })
            .filter(|g| !g.bars.is_empty())
            .collect();
        (
            "seconds from snapshot/load to the guest's first full touch (bar: median, line: min \
             to max)",
            groups,
        )
    }
}
