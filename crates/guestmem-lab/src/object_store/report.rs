//! The object-store scenario's Markdown report and plot.

use super::{CpuSplit, ObjectStoreResult, StoreSample};
use crate::plot::{Bar, BarGroup};
use crate::report::{header, LabReport};
use crate::run::{ratio, summarise};

/// Where both CPUs went from the VM's connect `until`, each variant whose rounds say (its
/// median round in each column); empty when none do.
fn cpu_table(
    until: &str,
    variants: &[super::StoreVariant],
    pick: fn(&StoreSample) -> Option<&CpuSplit>,
) -> String {
    let rows: Vec<String> = variants
        .iter()
        .filter(|v| v.samples.iter().any(|x| pick(&x.sample).is_some()))
        .map(|v| {
            let m =
                |f: fn(&CpuSplit) -> f64| summarise(&v.samples, |x| pick(x).map_or(0.0, f)).median;
            format!(
                "| {} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} |\n",
                v.name,
                m(|c| c.wall_secs),
                m(|c| c.vm),
                m(|c| c.server),
                m(|c| c.store),
                m(|c| c.wire),
                m(|c| c.rest() + c.lab),
                m(|c| c.idle),
                m(|c| c.steal),
            )
        })
        .collect();
    if rows.is_empty() {
        return String::new();
    }
    format!(
        "\nWhere both CPUs went from the VM's connect {until}: CPU seconds of each part (the \
         stand-in VM's reader; the page server's threads and its store client's; the S3 server; \
         the proxy, which stands for the wire; the rest of the host: the kernel's threads, other \
         processes, the lab's own), and of both CPUs idle and stolen by this machine's host \
         (threads by their run time, the host by `/proc/stat`'s ticks of 10 ms: the rest is \
         known to about 0.01 s a CPU). Each column the rounds' median.\n\n\
         | variant | wall, s | VM | page server | S3 server | proxy | rest | idle | steal |\n\
         |---|---|---|---|---|---|---|---|---|\n{}",
        rows.concat()
    )
}

impl LabReport for ObjectStoreResult {
    fn markdown(&self) -> String {
        let s = &self.settings;
        let b = &self.body;
        let mib = |x: u64| x as f64 / (1 << 20) as f64;
        let mut md = header(
            "object-store (a VM's memory served straight from S3)",
            &self.run,
            &s.thp_mode,
            &s.protocol,
            &format!(
                "{} MiB snapshot (incompressible), frames of {} KiB (a frame a fault), the local \
                 file's block {} KiB; working set {:.0}% of memory in runs of {} KiB at random places ({} MiB); \
                 the store is s3s-fs on this host at nice {} (its files in this host's page cache as \
                 likely as not: a cold cache is an empty frame cache) behind a proxy that holds \
                 each answer's first byte until {:?} ms after its request (a floor, the server's \
                 own time inside it) and a link of {} MiB/s; the local file read through before \
                 each of its rounds; one stand-in VM (Firecracker's handshake) reading one \
                 word a page, each checked; {} pool threads, one prefetch thread. Timed: {}. \
                 Medians over the measured rounds (min-max in brackets).\n",
                s.size >> 20,
                s.frame_bytes >> 10,
                s.block_bytes >> 10,
                s.ws_fraction * 100.0,
                s.ws_run >> 10,
                mib(b.ws_bytes),
                s.store_nice,
                s.latencies_ms,
                s.bandwidth >> 20,
                s.pool,
                self.timed
            ),
        );
        let file = b.variants.iter().find(|v| v.name == "file");
        md.push_str(
            "| variant | working set read, s | /file | all read, s | /file | demand miss p50 ms | p99 ms \
             | GETs at ws | MiB at ws | /ws bytes | GETs | MiB fetched | GETs per frame read |\n\
             |---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        );
        for v in &b.variants {
            let m = |f: fn(&StoreSample) -> f64| summarise(&v.samples, f).median;
            let vs =
                |x: f64, f: Option<f64>| f.map_or("".into(), |f| format!("{:.2}x", ratio(x, f)));
            let many = v.name.starts_with("vms");
            md.push_str(&format!(
                "| {} | {:.3} ({:.3}-{:.3}) | {} | {} | {} | {:.2} | {:.2} | {:.0} | {:.1} | {:.2}x | {:.0} | {:.1} | {:.2} |\n",
                v.name,
                v.ws_secs.median,
                v.ws_secs.min,
                v.ws_secs.max,
                if many { String::new() } else { vs(v.ws_secs.median, file.map(|f| f.ws_secs.median)) },
                if many { "(ws only)".into() } else { format!("{:.3} ({:.3}-{:.3})", v.all_secs.median, v.all_secs.min, v.all_secs.max) },
                if many { String::new() } else { vs(v.all_secs.median, file.map(|f| f.all_secs.median)) },
                m(|s| s.miss_p50_us) / 1000.0,
                m(|s| s.miss_p99_us) / 1000.0,
                m(|s| s.gets_at_ws as f64),
                m(|s| s.bytes_at_ws as f64) / (1 << 20) as f64,
                ratio(m(|s| s.bytes_at_ws as f64), b.ws_bytes as f64),
                m(|s| s.gets as f64),
                m(|s| s.bytes as f64) / (1 << 20) as f64,
                ratio(m(|s| s.gets as f64), m(|s| s.frames_read as f64)),
            ));
        }
        if let Some(fw) = b.variants.iter().find(|v| v.name == "file+ws") {
            let each: Vec<String> = b
                .variants
                .iter()
                .filter(|v| v.name.starts_with("cold+ws"))
                .map(|v| {
                    format!(
                        "{} {:.2}x",
                        v.name,
                        ratio(v.ws_secs.median, fw.ws_secs.median)
                    )
                })
                .collect();
            md.push_str(&format!(
                "\nThe working set read against the file's with its working set prefetched too \
                 (`file+ws`, {:.3} s; in the file's blocks of {} KiB, where the store's are its \
                 frames): {}.\n",
                fw.ws_secs.median,
                s.block_bytes >> 10,
                each.join(", ")
            ));
        }
        let many_vms = |v: &&super::StoreVariant| v.name.starts_with(&format!("vms {} ", s.vms));
        let (many, one): (Vec<_>, Vec<_>) = b.variants.iter().partition(many_vms);
        let names = |vs: &[&super::StoreVariant]| {
            vs.iter()
                .map(|v| v.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        };
        if !one.is_empty() {
            md.push_str(&format!(
                "\nDemand misses ({}): the faults that brought their block in (from the store or \
                 the cache; not those that waited on a block another thread was bringing), timed \
                 by the page server from a fault thread's read of the fault to its install (a \
                 fault that waits for a thread first is not counted before that); quantiles as \
                 measured (nearest rank over the round's latest 4,096).\n",
                names(&one),
            ));
        }
        let seen: Vec<String> = one
            .iter()
            .filter(|v| v.samples.iter().any(|x| x.sample.vm_waits > 0))
            .map(|v| {
                let m = |f: fn(&StoreSample) -> f64| summarise(&v.samples, f).median;
                format!(
                    "{} p50 {:.2} ms, p99 {:.2} ms ({:.0} touches)",
                    v.name,
                    m(|x| x.vm_wait_p50_us) / 1000.0,
                    m(|x| x.vm_wait_p99_us) / 1000.0,
                    m(|x| x.vm_waits as f64),
                )
            })
            .collect();
        if !seen.is_empty() {
            md.push_str(&format!(
                "\nThe same misses as the VM saw them, where nothing is prefetched for it: its own \
                 wait at its first touch of each frame of its working set (its fault, the wait for \
                 a fault thread or for a block the prefetch thread was bringing, the GET, the \
                 install; a touch read-ahead had served already counts too), nearest rank, the \
                 rounds' medians: {}.\n",
                seen.join("; ")
            ));
        }
        if !many.is_empty() {
            md.push_str(&format!(
                "\nDemand misses ({}): each VM's own wait at its first touch of each frame of its \
                 working set (its fault, a fault thread, the GET or the one it joined, the \
                 install), every VM's of the round together, nearest rank; the median round's, \
                 the rounds' range in result.json.\n",
                names(&many),
            ));
        }
        md.push_str(&cpu_table(
            "until the working set was read",
            &b.variants,
            |x| x.cpu_ws.as_ref(),
        ));
        md.push_str(&cpu_table("until all memory was read", &b.variants, |x| {
            x.cpu_all.as_ref()
        }));
        let p = &b.push;
        md.push_str(&format!(
            "\nPush of the {} MiB file straight to the S3 server (no proxy; once, right after \
             the file was written, no warm-up): {:.2} s ({:.0} MiB/s), {:.1} MiB \
             stored. A diff rewriting {:.0}% of the pages, scattered ({:.1} MiB): pushed in {:.2} s, \
             {:.1} MiB stored, {:.1}% of the full push's bytes.\n",
            s.size >> 20,
            p.full_secs,
            ratio(mib(s.size), p.full_secs),
            mib(p.full_stored),
            s.diff_fraction * 100.0,
            mib(p.diff_changed),
            p.diff_secs,
            mib(p.diff_stored),
            100.0 * ratio(p.diff_stored as f64, p.full_stored as f64),
        ));
        let rate = |secs: f64| ratio(mib(s.size), secs);
        md.push_str(&format!(
            "\nWhat this rig's store delivers: every frame fetched once through the {} ms proxy, \
             kept nowhere, by 16 threads in {:.2} s ({:.0} MiB/s: 16 GETs at once, each waiting \
             its first byte) and by 64 in {:.2} s ({:.0} MiB/s). The S3 server (s3s-fs, a GET read \
             in one piece by the test kit), the proxy and the page server share this host's \
             CPUs: a cold variant reads no faster than 64 GETs at once deliver, and read-ahead \
             keeps at most 48 in flight.\n",
            s.latencies_ms.first().copied().unwrap_or(0),
            p.fetch_all_secs,
            rate(p.fetch_all_secs),
            p.fetch_all_64_secs,
            rate(p.fetch_all_64_secs),
        ));
        md.push_str(match b.rounds_kept {
            true => {
                "\nEach round's frame cache was kept until the run ended (synced to disk, \
                     untimed, after its round), not removed before the next round.\n"
            }
            false => {
                "\nEach round's frame cache was removed before the next round (the disk \
                      had no room to keep them all).\n"
            }
        });
        md
    }

    fn bars(&self) -> (&'static str, Vec<BarGroup>) {
        (
            "seconds until the working set was read (bar: median, line: min to max)",
            vec![BarGroup {
                title: format!("{} MiB", self.settings.size >> 20),
                bars: self
                    .body
                    .variants
                    .iter()
                    .map(|v| Bar::of(&v.name, &v.ws_secs))
                    .collect(),
            }],
        )
    }
}
