//! The move scenario's Markdown report and plot.

use super::{MoveResult, MoveSample};
use crate::plot::{Bar, BarGroup};
use crate::report::{header, LabReport};
use crate::run::{ratio, summarise};

impl LabReport for MoveResult {
    fn markdown(&self) -> String {
        let s = &self.settings;
        let mut md = header(
            "move (a running Firecracker VM moved between two page servers)",
            &self.run,
            &s.thp_mode,
            &s.protocol,
            &format!(
                "Real Firecracker, {} MiB VM restored from a base in the store (s3s-fs in this \
                 process, its objects in {}, its threads at nice {}) with track_dirty_pages; the guest writes {:?} MiB spread over its {} MiB \
                 region (runs of 64 KiB), then moves; two page servers on this host stand for the \
                 two hosts, both starting from a cache holding the base, the move authenticated \
                 with a move key (its messages MACed, the frames behind a token, the pieces \
                 sealed); a proxy adds {:?} ms of \
                 round trip to the control connection and to the source's frames (half of \
                 it each way, on top of each side's own time); the source's \
                 Firecracker writes the diff into {}. As it resumes on the \
                 destination the guest touches every page of its region (two qwords each, checked), \
                 then checks every qword; then the host compares every other page of its \
                 memory (written out by a Full snapshot) with the base's: a page not the \
                 base's outside the guest's own (the low MiB, its program's image) fails \
                 the run. Timed: {}. Medians over the \
                 measured rounds (min-max in brackets).\n",
                s.mem_mib,
                s.store_dir.display(),
                s.store_nice,
                s.dirty_mib,
                s.region_mib,
                s.rtt_ms,
                s.diff_dir.display(),
                self.timed
            ),
        );
        md.push_str(
            "| variant | pause ms | pause | Diff snapshot | send | frames | wait | (load) | (open) | commit | diff MiB \
             | sent / diff | remote GET p50 ms | p99 ms | a fault's own: GETs | p50 ms | p99 ms | remote faults | wait p50 ms | p99 ms \
             | miss p50 ms | p99 ms | risk window ms | check s | BAD |\n\
             |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        );
        for v in &self.body.variants {
            let m = |f: fn(&MoveSample) -> f64| summarise(&v.samples, f).median;
            md.push_str(&format!(
                "| {} | {:.1} ({:.1}-{:.1}) | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} \
                 | {:.3} | {:.2} | {:.2} | {:.0} | {:.2} | {:.2} | {:.0} | {:.2} | {:.2} | {:.2} | {:.2} | {:.0} | {:.1} | {:.0} |\n",
                v.name,
                v.pause_ms.median,
                v.pause_ms.min,
                v.pause_ms.max,
                m(|s| s.step_pause_ms),
                m(|s| s.snapshot_ms),
                m(|s| s.send_ms),
                m(|s| s.frames_ms),
                m(|s| s.wait_ms),
                m(|s| s.load_ms),
                m(|s| s.open_ms),
                m(|s| s.commit_ms),
                m(|s| s.diff_bytes as f64) / (1 << 20) as f64,
                ratio(m(|s| s.bytes_sent as f64), m(|s| s.diff_bytes as f64)),
                m(|s| s.remote_p50_us) / 1000.0,
                m(|s| s.remote_p99_us) / 1000.0,
                m(|s| s.fault_gets as f64),
                m(|s| s.fault_get_p50_us) / 1000.0,
                m(|s| s.fault_get_p99_us) / 1000.0,
                m(|s| s.remote_faults as f64),
                m(|s| s.remote_fault_p50_us) / 1000.0,
                m(|s| s.remote_fault_p99_us) / 1000.0,
                m(|s| s.miss_p50_us) / 1000.0,
                m(|s| s.miss_p99_us) / 1000.0,
                m(|s| s.risk_ms),
                m(|s| s.check_secs),
                m(|s| s.bad as f64),
            ));
        }
        md.push_str(
            "\nSteps: `pause` is Firecracker's `PATCH /vm Paused`; `Diff snapshot` its \
             `snapshot/create` writing the vmstate and the dirty pages; `send` the vmstate to the \
             destination, which starts loading it; `frames` the chain's manifest made on the source \
             from the diff's shape, its pieces named later (nothing of the diff read or \
             hashed; a chain too deep is cut and hashed instead), while the destination loads; `wait` from the manifest \
             sent to the destination's word that the VM is loaded. In brackets, beside those on \
             the destination: `load` its Firecracker's `snapshot/load` (the VM left paused) from \
             the vmstate's arrival, and `open` the chain checked and served there. `commit` the \
             source's word to run it, the destination's `PATCH /vm Resumed`, its answer. `sent / diff`: bytes \
             of frames the source served against the diff's bytes (the destination stops asking \
             the source once the store holds the diff, so this can be below 1). `remote GET`: \
             the destination's GETs to the source (frame objects of 256 KiB of memory, the diff's \
             pages packed), many in flight while it fetches the whole diff ahead of the guest; `a fault's own`: \
             those a fault sent itself, not read-ahead (a fault on a frame read-ahead is already \
             fetching waits on that GET instead). `remote faults`: the destination's faults on \
             frames the source owed and it did not hold yet, and how long each waited for its frame \
             (its own GET, or one in flight it joined): a remote fault but for the install, which \
             `miss` holds; its quantiles are of the waits as measured (nearest rank), the \
             others' a histogram bucket's upper bound (up to 19% above). \
             `miss`: the destination's faults that brought their block (a frame) in, from the \
             cache or the source. `faults only`: the destination prefetches nothing, so every frame \
             the source owes comes through a fault. `risk window`: from \
             the pause until the store held the diff and the destination released the source.\n",
        );
        md
    }

    fn bars(&self) -> (&'static str, Vec<BarGroup>) {
        (
            "the pause, ms (bar: median, line: min to max)",
            vec![BarGroup {
                title: "pause".into(),
                bars: self
                    .body
                    .variants
                    .iter()
                    .map(|v| Bar::of(&v.name, &v.pause_ms))
                    .collect(),
            }],
        )
    }
}
