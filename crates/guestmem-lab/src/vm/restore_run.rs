//! `guestmem-lab vm --restore` and `--save`: starting a run from a snapshot (guestmem's restore
//! engine, or the Firecracker-style peer), the guest's verify pass over every page it wrote
//! before the save, and the save after the passes.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use guestmem::restore::{self, LazyReport, LazyRestore, Prefetch, RestoreConfig, RestoreMode};
use guestmem::snapshot::{self, Image, ImageRegion, SaveConfig, SaveReport};
use guestmem::{GuestAddress, GuestMap, Region};

use super::fc_peer::FcPeer;
use super::guest::DATA_GPA;
use super::guest::{self, Workload};
use super::VmError;

/// The manifest note holding the tag of the guest's last write pass.
pub const TAG_KEY: &str = "guestmem.vm.tag";

/// How `guestmem-lab vm --restore` restores.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestoreRun {
    /// The snapshot directory.
    pub dir: PathBuf,
    /// The mode.
    pub mode: RestoreMode,
    /// Lazy: fault-handler threads.
    pub handler_threads: usize,
    /// Lazy: prefetch threads (0: as many as CPUs).
    pub prefetch_threads: usize,
    /// Lazy: what to prefetch.
    pub prefetch: Prefetch,
    /// Lazy: write the order the guest faulted blocks in into the snapshot's manifest.
    pub record: bool,
    /// Serve faults with the Firecracker-style peer ([`super::fc_peer`]) instead of
    /// guestmem's engine (`mode` is then ignored).
    pub fc_peer: bool,
}

/// What a restore did, seen from the guest.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RestoreRunReport {
    /// Who restored: `guestmem` or `fc-peer` (the Firecracker-style peer).
    pub server: &'static str,
    /// The mode (guestmem's).
    pub mode: RestoreMode,
    /// Lazy: what was prefetched.
    pub prefetch: Prefetch,
    /// Restore setup: from the start until the restore call returned (eager: all of it).
    pub setup_secs: f64,
    /// From the start until the end of the guest's verify pass over every page it wrote
    /// before the save.
    pub verify_done_secs: f64,
    /// The verify pass alone.
    pub verify_secs: f64,
    /// Pages the guest verified.
    pub verify_pages: u64,
    /// Dwords that differed (must be 0).
    pub mismatches: u64,
    /// The guest's demand paging rate during the verify pass: pages verified per second.
    pub demand_paging_pages_per_sec: f64,
    /// Lazy: what the restore engine did by the end of the run (faults = guest and VMM
    /// faults that waited on a handler).
    pub lazy: Option<LazyReport>,
    /// Blocks recorded as the working set (written to the manifest with `record`).
    pub recorded_blocks: usize,
    /// With the Firecracker-style peer: faults it served (one 4 KiB page each).
    pub peer_faults: Option<u64>,
    /// THP (or hugetlb) bytes over the data memory, after the verify pass.
    pub huge_coverage: f64,
}

/// A run started from a snapshot, until its restore is finished.
pub(crate) struct Started {
    run: RestoreRun,
    image: Image,
    tag: u32,
    lazy: Option<LazyRestore>,
    peer: Option<FcPeer>,
    setup: Duration,
}

/// Opens the snapshot of `run` and restores it (or starts the peer on it); returns the map.
pub(crate) fn start(run: &RestoreRun, t0: Instant) -> Result<(GuestMap, Started), VmError> {
    let image = Image::open(&run.dir)?;
    let tag: u32 = image
        .meta()
        .get(TAG_KEY)
        .and_then(|t| t.parse().ok())
        .ok_or_else(|| {
            VmError::Config(format!(
                "{}: not saved by guestmem-lab vm (no {TAG_KEY} note)",
                run.dir.display()
            ))
        })?;
    let (map, lazy, peer) = if run.fc_peer {
        if image.chain_len() != 1 {
            return Err(VmError::Config(
                "the Firecracker-style peer serves one full save, not a chain".into(),
            ));
        }
        let map = GuestMap::from_specs(&image.specs())?;
        let peer = FcPeer::start(map.view().regions(), image.memory_path())
            .map_err(|e| VmError::Config(format!("starting the Firecracker-style peer: {e}")))?;
        (map, None, Some(peer))
    } else {
        let cfg = RestoreConfig {
            mode: run.mode,
            threads: if run.prefetch_threads == 0 {
                RestoreConfig::default().threads
            } else {
                run.prefetch_threads
            },
            handler_threads: run.handler_threads,
            prefetch: run.prefetch,
            ..RestoreConfig::default()
        };
        let r = restore::restore(&image, &image.specs(), &cfg)?;
        (r.map, r.lazy, None)
    };
    let started = Started {
        run: run.clone(),
        image,
        tag,
        lazy,
        peer,
        setup: t0.elapsed(),
    };
    Ok((map, started))
}

/// `e`, or the lazy restore's failure that caused it.
pub(crate) fn failed(started: Option<&Started>, e: VmError) -> VmError {
    match started
        .and_then(|s| s.lazy.as_ref())
        .and_then(|l| l.failure())
    {
        Some(msg) => VmError::Restore(msg),
        None => e,
    }
}

impl Started {
    /// The image's data regions (the control region is below them).
    pub(crate) fn data_regions(&self) -> Vec<&ImageRegion> {
        self.image
            .regions()
            .iter()
            .filter(|r| r.guest_addr >= DATA_GPA)
            .collect()
    }

    /// Has the guest verify every page of `data` (`pages` of them), stopping its vCPUs if
    /// the lazy restore fails; records the working set if asked.
    pub(crate) fn verify(
        &self,
        work: &Workload,
        data: &[Arc<Region>],
        pages: u64,
        t0: Instant,
    ) -> Result<RestoreRunReport, VmError> {
        if let Some(l) = &self.lazy {
            let stopper = work.stopper();
            l.on_failure(move |_| stopper.stop());
        }
        let v = work.verify(self.tag).map_err(|e| failed(Some(self), e))?;
        let verify_done = t0.elapsed();
        let mismatches: u64 = v.values.iter().map(|&x| u64::from(x)).sum();
        if mismatches != 0 {
            return Err(VmError::Config(format!(
                "the restored guest found {mismatches} dwords differing from what it wrote before the save"
            )));
        }
        let mut recorded_blocks = 0;
        if let (Some(l), true) = (&self.lazy, self.run.record) {
            let ws = l.working_set();
            self.image.record_working_set(&ws)?;
            recorded_blocks = ws.len();
        }
        let verify_secs = v.elapsed.as_secs_f64();
        Ok(RestoreRunReport {
            server: if self.run.fc_peer {
                "fc-peer"
            } else {
                "guestmem"
            },
            mode: self.run.mode,
            prefetch: self.run.prefetch,
            setup_secs: self.setup.as_secs_f64(),
            verify_done_secs: verify_done.as_secs_f64(),
            verify_secs,
            verify_pages: pages,
            mismatches,
            demand_paging_pages_per_sec: pages as f64 / verify_secs.max(1e-9),
            lazy: None,
            recorded_blocks,
            peer_faults: None,
            huge_coverage: huge_coverage(data),
        })
    }

    /// Stops the peer or finishes the lazy restore, completing `report`.
    pub(crate) fn finish(self, mut report: RestoreRunReport) -> Result<RestoreRunReport, VmError> {
        if let Some(p) = self.peer {
            let faults = p
                .stop()
                .map_err(|e| VmError::Config(format!("the Firecracker-style peer failed: {e}")))?;
            report.peer_faults = Some(faults);
        }
        if let Some(l) = self.lazy {
            report.lazy = Some(l.finish()?);
        }
        Ok(report)
    }
}

/// Saves `map` into `dir` after the guest's last pass, `tag`. The guest wrote dword 0 of
/// every data page; the host writes the last dword too, so a restored guest's verify pass
/// checks both ends of every page.
pub(crate) fn save(
    map: &GuestMap,
    data: &[Arc<Region>],
    tag: u32,
    dir: &Path,
) -> Result<SaveReport, VmError> {
    let t = map.translator();
    for r in data {
        for gpa in (r.guest_addr().0..r.guest_end()).step_by(4096) {
            let p = guest::pattern(gpa, tag).to_le_bytes();
            t.write_in_region(GuestAddress(gpa + 4092), &p)?;
        }
    }
    let mut meta = std::collections::BTreeMap::new();
    meta.insert(TAG_KEY.to_string(), tag.to_string());
    let cfg = SaveConfig {
        meta,
        ..SaveConfig::default()
    };
    Ok(snapshot::save(&map.view(), dir, &cfg)?)
}

/// THP or hugetlb bytes over the bytes of `regions`.
fn huge_coverage(regions: &[Arc<guestmem::Region>]) -> f64 {
    let (mut huge, mut size) = (0u64, 0u64);
    for r in regions {
        if r.is_hugetlb() {
            huge += r.size();
        } else if let Ok(u) = guestmem::inspect::inspect_region(r) {
            huge += (u.huge_coverage() * r.size() as f64) as u64;
        }
        size += r.size();
    }
    if size == 0 {
        0.0
    } else {
        huge as f64 / size as f64
    }
}
