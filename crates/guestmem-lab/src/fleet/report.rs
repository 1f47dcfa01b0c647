//! The fleet scenario's Markdown report and plot.

use super::{FleetResult, FleetSample};
use crate::plot::{Bar, BarGroup};
use crate::report::{header, LabReport};
use crate::run::summarise;

impl LabReport for FleetResult {
    fn markdown(&self) -> String {
        let s = &self.settings;
        let mut md = header(
            "fleet (many VMs restored at once from one snapshot)",
            &self.run,
            &s.thp_mode,
            &s.protocol,
            &format!(
                "{} stand-in VMs of {} MiB each, one reader (vCPU) thread per VM reading one \
                 word per 4 KiB page; {} fault-serving threads (the fleet's pool, or each \
                 once-server's); Firecracker's example handler {}. Timed: {}. Latency is what \
                 each read took as the vCPU saw it; medians over the measured rounds.\n",
                s.vms,
                s.size >> 20,
                s.pool,
                s.fc_handler
                    .as_ref()
                    .map_or("not found: left out".to_string(), |p| format!(
                        "`{}`",
                        p.display()
                    )),
                self.timed
            ),
        );
        md.push_str(
            "| variant | median s | min s | max s | spread (slowest/fastest VM) | Jain | p50 us \
             | p99 us | p999 us | worst VM p99 us | server CPU s | server read MiB | faults |\n\
             |---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        );
        for v in &self.body.variants {
            let m = |f: fn(&FleetSample) -> f64| summarise(&v.samples, f).median;
            let read = v
                .samples
                .iter()
                .rev()
                .find_map(|s| s.sample.server_read_bytes)
                .map_or("n/a".into(), |b| format!("{}", b >> 20));
            let faults = v
                .samples
                .iter()
                .rev()
                .find_map(|s| s.sample.faults)
                .map_or("n/a".into(), |f| f.to_string());
            md.push_str(&format!(
                "| {} | {:.3} | {:.3} | {:.3} | {:.2} | {:.3} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} | {} | {} |\n",
                v.name,
                v.seconds.median,
                v.seconds.min,
                v.seconds.max,
                m(|s| s.spread),
                m(|s| s.jain),
                m(|s| s.p50_us),
                m(|s| s.p99_us),
                m(|s| s.p999_us),
                m(|s| s.worst_vm_p99_us),
                m(|s| s.server_cpu_secs),
                read,
                faults,
            ));
        }
        md
    }

    fn bars(&self) -> (&'static str, Vec<BarGroup>) {
        (
            "seconds until every VM read every page (bar: median, line: min to max)",
            vec![BarGroup {
                title: format!(
                    "{} VMs x {} MiB",
                    self.settings.vms,
                    self.settings.size >> 20
                ),
                bars: self
                    .body
                    .variants
                    .iter()
                    .map(|v| Bar::of(&v.name, &v.seconds))
                    .collect(),
            }],
        )
    }
}
