//! The restore scenario: how soon does a restored VM's memory become readable? Restoring
//! from a snapshot makes every first touch a fault, and Firecracker users write their own
//! userfaultfd page servers to do better than its one-thread, one-page-per-fault examples.
//!
//! For each image size, a guestmem save (a distinct word at both ends of every page; its
//! `memory` file is Firecracker's memory-file layout, read into the page cache before the
//! rounds) is restored and then read by 1..CPUs "vCPU" threads, each reading one word of
//! every page of its contiguous share, as a restored guest touching all its memory would:
//!
//! - `fc-peer`: the [Firecracker stand-in](guestmem_testkit::firecracker) hands its userfaultfd to the
//!   lab's Firecracker-style server ([`crate::vm::fc_peer`]: one thread, one 4 KiB
//!   `UFFDIO_COPY` per fault from a private mapping of the file, no prefetch).
//! - `serve-uffd`: the same handshake to guestmem's page server
//!   ([`guestmem::restore::remote`]) with 2 handler threads and no prefetch.
//! - `serve-uffd-prefetch`: the same, prefetching a working set recorded by a `serve-uffd`
//!   run before the rounds (recorded prefetch), then the rest.
//! - `mapped`: guestmem's mapped restore (Firecracker's default `File` backend: the memory
//!   file mapped privately, the kernel reading each page at its first touch).
//! - `eager`: guestmem's eager restore (populate and read everything, all CPUs), then the
//!   same reads.
//!
//! **What is timed**: from just before the stand-in connects (for the page servers), or the
//! restore call (mapped, eager), until the last reader thread has read its last page. The
//! stand-in's mapping and registration come before. Every run's words read are checked
//! against the memory file (an XOR digest of the first word of each page): a run that read
//! wrong data fails the scenario.

use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use guestmem::layout::RegionSpec;
use guestmem::restore::{restore, Prefetch, RestoreConfig, RestoreMode};
use guestmem::serve::{Handshake, Listener, MemoryFile, Server, ServerConfig, Socket, Vms};
use guestmem::snapshot::{save, Image, SaveConfig};
use guestmem::vm_memory::Bytes;
use guestmem::{GuestAddress, GuestMap};

use crate::error::LabError;
use crate::plot::{Bar, BarGroup};
use crate::report::{header, LabReport, LabResult};
use crate::run::{available_cpus, ratio, summarise, thp_mode, Order, Protocol, RunInfo};
use crate::run::{Sampled, Summary};
use crate::vm::fc_peer::FcPeer;
use guestmem_testkit::firecracker::{read_ranges, Standin, PAGE};

/// The scenario's name.
pub const SCENARIO: &str = "restore";
/// Default image sizes.
pub const DEFAULT_SIZES: [u64; 2] = [256 << 20, 1 << 30];
/// Default measured rounds.
pub const DEFAULT_ROUNDS: usize = 5;
/// Handler threads of the serve-uffd variants (the "2 handler threads").
pub const DEFAULT_HANDLERS: usize = 2;
/// How long a handshake may take in the lab.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How to run the scenario.
#[derive(Debug, Clone)]
pub struct RestoreLabConfig {
    /// Image sizes (each a multiple of 1 MiB).
    pub sizes: Vec<u64>,
    /// Reader ("vCPU") thread counts.
    pub vcpus: Vec<usize>,
    /// Handler threads of the serve-uffd variants.
    pub handlers: usize,
    /// Where images and sockets go (removed afterwards).
    pub work_dir: PathBuf,
    /// Warm-up, rounds, order.
    pub protocol: Protocol,
    /// The command line to record.
    pub command: String,
}

impl Default for RestoreLabConfig {
    fn default() -> Self {
        RestoreLabConfig {
            sizes: DEFAULT_SIZES.to_vec(),
            vcpus: (1..=available_cpus()).collect(),
            handlers: DEFAULT_HANDLERS,
            work_dir: std::env::temp_dir()
                .join(format!("guestmem-lab-restore-{}", std::process::id())),
            protocol: Protocol {
                warmup: 1,
                rounds: DEFAULT_ROUNDS,
                order: Order::Rotate,
            },
            command: String::new(),
        }
    }
}

/// How memory is restored and served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RestoreKind {
    /// Firecracker-style server.
    FcPeer,
    /// guestmem's page server, no prefetch.
    ServeUffd,
    /// guestmem's page server, recorded prefetch.
    ServeUffdPrefetch,
    /// guestmem's mapped restore.
    Mapped,
    /// guestmem's eager restore.
    Eager,
}

const KINDS: [RestoreKind; 5] = [
    RestoreKind::FcPeer,
    RestoreKind::ServeUffd,
    RestoreKind::ServeUffdPrefetch,
    RestoreKind::Mapped,
    RestoreKind::Eager,
];

impl RestoreKind {
    /// The name in reports.
    pub fn name(self) -> &'static str {
        match self {
            RestoreKind::FcPeer => "fc-peer",
            RestoreKind::ServeUffd => "serve-uffd",
            RestoreKind::ServeUffdPrefetch => "serve-uffd-prefetch",
            RestoreKind::Mapped => "mapped",
            RestoreKind::Eager => "eager",
        }
    }
}

/// One run of one variant.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RestoreSample {
    /// Timed seconds (see the module docs).
    pub seconds: f64,
    /// The readers' own seconds, each.
    pub thread_seconds: Vec<f64>,
    /// Faults the server read (page servers only).
    pub faults: u64,
    /// Blocks (or pages, for fc-peer) the server brought in for faults.
    pub fault_blocks: u64,
    /// Blocks the server prefetched.
    pub prefetched_blocks: u64,
}

/// One variant's results.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RestoreVariant {
    /// Image size, bytes.
    pub size: u64,
    /// Reader threads.
    pub vcpus: usize,
    /// The way.
    pub kind: RestoreKind,
    /// Every run, warm-ups included.
    pub samples: Vec<Sampled<RestoreSample>>,
    /// Timed seconds over the measured rounds.
    pub seconds: Summary,
    /// The fc-peer median over this one's, same size and readers (higher: sooner).
    pub speedup_vs_fc_peer: f64,
}

/// Settings a result was measured with.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RestoreSettings {
    /// Image sizes.
    pub sizes: Vec<u64>,
    /// Reader thread counts.
    pub vcpus: Vec<usize>,
    /// serve-uffd handler threads.
    pub handlers: usize,
    /// serve-uffd-prefetch and eager threads.
    pub prefetch_threads: usize,
    /// Warm-up, rounds, order.
    pub protocol: Protocol,
    /// THP mode.
    pub thp_mode: String,
}

/// What the scenario found.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RestoreFindings {
    /// Every variant of every size and reader count.
    pub variants: Vec<RestoreVariant>,
}

/// The scenario's whole result.
pub type RestoreResult = LabResult<RestoreSettings, RestoreFindings>;

fn err(what: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> LabError {
    LabError::restore(what)
}

/// The word the image holds at byte `at` (first and last word of each page; the rest 0).
fn pattern(at: u64) -> u64 {
    (at / PAGE as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1
}

/// An image of `size` bytes in `dir`; and the XOR of the first word of every page.
fn make_image(dir: &Path, size: u64) -> Result<(Image, u64), LabError> {
    let _ = std::fs::remove_dir_all(dir);
    let map = GuestMap::from_specs(&[RegionSpec::new(GuestAddress(0), size)]).map_err(err)?;
    let snap = map.view();
    let mut digest = 0;
    for p in 0..size / PAGE as u64 {
        let at = p * PAGE as u64;
        digest ^= pattern(at);
        snap.write_slice(&pattern(at).to_ne_bytes(), GuestAddress(at))
            .map_err(err)?;
        snap.write_slice(
            &pattern(at).to_ne_bytes(),
            GuestAddress(at + PAGE as u64 - 8),
        )
        .map_err(err)?;
    }
    save(&snap, dir, &SaveConfig::default()).map_err(err)?;
    drop(snap);
    drop(map);
    let image = Image::open(dir).map_err(err)?;
    // The page cache holds the memory file from here on: every variant reads it from there.
    std::fs::read(image.memory_path()).map_err(err)?;
    Ok((image, digest))
}

/// One page-server run: the stand-in connects, `serve` serves, `vcpus` threads read all.
/// Returns the sample and the server's working set.
fn served(
    image: &Image,
    socket: &Path,
    vcpus: usize,
    kind: RestoreKind,
    cfg: &Serving,
    digest: u64,
) -> Result<(RestoreSample, Vec<u64>), LabError> {
    let _ = std::fs::remove_file(socket);
    let size = image.memory_bytes() as usize;
    let mut vm = Standin::new(&[size], false).map_err(err)?;
    let mem = image.memory_path().to_path_buf();
    let (run, seconds, faults, fault_blocks, prefetched, ws) = if kind == RestoreKind::FcPeer {
        let listener = UnixListener::bind(socket).map_err(err)?;
        let t0 = Instant::now();
        vm.connect(socket).map_err(err)?;
        let h = Handshake::accept(&listener, HANDSHAKE_TIMEOUT, HANDSHAKE_TIMEOUT).map_err(err)?;
        let (regions, fd, _sock) = h.into_parts();
        let peer = FcPeer::serve_handshake(&regions, fd, &mem).map_err(err)?;
        let run = vm.read_all(vcpus);
        let seconds = t0.elapsed().as_secs_f64();
        vm.disconnect();
        let n = peer.stop().map_err(err)?;
        (run, seconds, n, n, 0, Vec::new())
    } else {
        let server = Server::new(
            vec![Socket {
                listener: Listener::bind(socket).map_err(err)?,
                memory: MemoryFile::open(&mem).map_err(err)?,
                working_set: cfg.working_set.clone(),
            }],
            ServerConfig {
                handler_threads: cfg.handlers,
                prefetch_threads: cfg.prefetch_threads,
                vms: Vms::One {
                    wait: Some(HANDSHAKE_TIMEOUT),
                },
                ..ServerConfig::default()
            },
        )
        .map_err(err)?;
        let t0 = Instant::now();
        let waiter = std::thread::spawn(move || server.run());
        vm.connect(socket).map_err(err)?;
        let run = vm.read_all(vcpus);
        let seconds = t0.elapsed().as_secs_f64();
        vm.disconnect();
        let rep = waiter
            .join()
            .map_err(|_| err("the page server panicked"))?
            .map_err(err)?;
        let last = rep
            .last
            .ok_or_else(|| err("the page server served no VM"))?;
        let e = last.engine;
        (
            run,
            seconds,
            e.faults,
            e.fault_blocks,
            e.prefetched_blocks,
            last.working_set,
        )
    };
    check(kind, run.digest, digest)?;
    Ok((
        RestoreSample {
            seconds,
            thread_seconds: run.thread_seconds,
            faults,
            fault_blocks,
            prefetched_blocks: prefetched,
        },
        ws,
    ))
}

/// How guestmem's page server is set for a served restore.
#[derive(Debug, Clone)]
struct Serving {
    handlers: usize,
    prefetch_threads: usize,
    working_set: Vec<u64>,
}

fn check(kind: RestoreKind, got: u64, want: u64) -> Result<(), LabError> {
    if got != want {
        return Err(err(format!(
            "{}: the words read do not match the image (digest {got:#x}, expected {want:#x})",
            kind.name()
        )));
    }
    Ok(())
}

/// A mapped or eager restore, then the reads.
fn restored(
    image: &Image,
    vcpus: usize,
    kind: RestoreKind,
    threads: usize,
    digest: u64,
) -> Result<RestoreSample, LabError> {
    let cfg = RestoreConfig {
        mode: if kind == RestoreKind::Eager {
            RestoreMode::Eager
        } else {
            RestoreMode::Mapped
        },
        threads,
        handler_threads: 1,
        prefetch: Prefetch::None,
        ..RestoreConfig::default()
    };
    let t0 = Instant::now();
    let r = restore(image, &image.specs(), &cfg).map_err(err)?;
    let snap = r.map.view();
    let ranges: Vec<(usize, usize)> = snap
        .regions()
        .iter()
        .map(|reg| (reg.host_addr() as usize, reg.size() as usize))
        .collect();
    // SAFETY: the ranges are the regions of `snap`, which keeps them mapped until dropped
    // below, after the reads.
    let run = unsafe { read_ranges(&ranges, vcpus) };
    let seconds = t0.elapsed().as_secs_f64();
    drop(snap);
    check(kind, run.digest, digest)?;
    Ok(RestoreSample {
        seconds,
        thread_seconds: run.thread_seconds,
        faults: 0,
        fault_blocks: 0,
        prefetched_blocks: 0,
    })
}

/// Runs the scenario and returns its result; writes nothing but its scratch images (in
/// `work_dir`, removed afterwards).
pub fn run_restore(cfg: &RestoreLabConfig) -> Result<RestoreResult, LabError> {
    cfg.protocol.validate(SCENARIO)?;
    let bad = |reason: String| LabError::Config {
        scenario: SCENARIO,
        reason,
    };
    if cfg.sizes.is_empty() || cfg.sizes.iter().any(|&s| s == 0 || s % (1 << 20) != 0) {
        return Err(bad(
            "sizes must be given, each a non-zero multiple of 1 MiB".into(),
        ));
    }
    if cfg.vcpus.is_empty() || cfg.vcpus.contains(&0) || cfg.handlers == 0 {
        return Err(bad("vCPU and handler counts must be non-zero".into()));
    }
    crate::run::in_work_dir(&cfg.work_dir, || run_in(cfg))
}

fn run_in(cfg: &RestoreLabConfig) -> Result<RestoreResult, LabError> {
    let run = RunInfo::collect(cfg.command.clone());
    let cpus = available_cpus();
    let socket = cfg.work_dir.join("uffd.sock");
    let mut out = Vec::new();
    for &size in &cfg.sizes {
        let (image, digest) =
            make_image(&cfg.work_dir.join(format!("image-{}M", size >> 20)), size)?;
        let plain = Serving {
            handlers: cfg.handlers,
            prefetch_threads: 0,
            working_set: Vec::new(),
        };
        for &vcpus in &cfg.vcpus {
            // Record the working set the prefetch variant starts from: a serve-uffd run's
            // faults, in order.
            let (_, recorded) = served(
                &image,
                &socket,
                vcpus,
                RestoreKind::ServeUffd,
                &plain,
                digest,
            )?;
            let prefetch = Serving {
                prefetch_threads: cpus,
                working_set: recorded,
                ..plain.clone()
            };
            let samples = cfg.protocol.run(KINDS.len(), |i| match KINDS[i] {
                k @ (RestoreKind::Mapped | RestoreKind::Eager) => {
                    restored(&image, vcpus, k, cpus, digest)
                }
                k @ RestoreKind::ServeUffdPrefetch => {
                    served(&image, &socket, vcpus, k, &prefetch, digest).map(|r| r.0)
                }
                k => served(&image, &socket, vcpus, k, &plain, digest).map(|r| r.0),
            })?;
            let vs: Vec<RestoreVariant> = KINDS
                .iter()
                .zip(samples)
                .map(|(&kind, samples)| RestoreVariant {
                    size,
                    vcpus,
                    kind,
                    seconds: summarise(&samples, |s| s.seconds),
                    samples,
                    speedup_vs_fc_peer: 0.0,
                })
                .collect();
            let fc = vs[0].seconds.median;
            out.extend(vs.into_iter().map(|mut v| {
                v.speedup_vs_fc_peer = ratio(fc, v.seconds.median);
                v
            }));
        }
    }
    Ok(LabResult {
        scenario: SCENARIO.into(),
        seeds: Vec::new(),
        run,
        settings: RestoreSettings {
            sizes: cfg.sizes.clone(),
            vcpus: cfg.vcpus.clone(),
            handlers: cfg.handlers,
            prefetch_threads: cpus,
            protocol: cfg.protocol,
            thp_mode: thp_mode(),
        },
        timed: "page servers: from just before the stand-in connects and sends its handshake \
                to the last reader's last page; mapped and eager: from the restore call to \
                the last reader's last page. Mapping and registering the stand-in's memory \
                come before; the image's memory file is in the page cache"
            .into(),
        body: RestoreFindings { variants: out },
    })
}

impl LabReport for RestoreResult {
    fn markdown(&self) -> String {
        let s = &self.settings;
        let mut md = header(
            "restore (snapshot restore, Firecracker's page-server handshake)",
            &self.run,
            &s.thp_mode,
            &s.protocol,
            &format!(
                "Images of {} MiB; {} reader (vCPU) threads reading one word per 4 KiB page of \
                 their share; serve-uffd: {} handler threads; serve-uffd-prefetch and eager: \
                 {} threads. Timed: {}.\n",
                s.sizes
                    .iter()
                    .map(|b| (b >> 20).to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                s.vcpus
                    .iter()
                    .map(|v| v.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                s.handlers,
                s.prefetch_threads,
                self.timed
            ),
        );
        md.push_str(
            "| size MiB | vCPUs | variant | median s | min s | max s | GB/s @median \
             | speed-up vs fc-peer | faults | blocks faulted | blocks prefetched |\n\
             |---|---|---|---|---|---|---|---|---|---|---|\n",
        );
        for v in &self.body.variants {
            let last = v.samples.last().map(|s| &s.sample);
            md.push_str(&format!(
                "| {} | {} | {} | {:.3} | {:.3} | {:.3} | {:.2} | {:.2}x | {} | {} | {} |\n",
                v.size >> 20,
                v.vcpus,
                v.kind.name(),
                v.seconds.median,
                v.seconds.min,
                v.seconds.max,
                ratio(v.size as f64 / 1e9, v.seconds.median),
                v.speedup_vs_fc_peer,
                last.map_or(0, |s| s.faults),
                last.map_or(0, |s| s.fault_blocks),
                last.map_or(0, |s| s.prefetched_blocks),
            ));
        }
        md
    }

    fn bars(&self) -> (&'static str, Vec<BarGroup>) {
        let mut groups: Vec<BarGroup> = Vec::new();
        for v in &self.body.variants {
            let title = format!("{} MiB, {} vCPUs", v.size >> 20, v.vcpus);
            if groups.last().is_none_or(|g| g.title != title) {
                groups.push(BarGroup {
                    title,
                    bars: Vec::new(),
                });
            }
            groups
                .last_mut()
                .expect("pushed")
                .bars
                .push(Bar::of(v.kind.name(), &v.seconds));
        }
        (
            "seconds until every page is read (bar: median, line: min to max)",
            groups,
        )
    }
}
