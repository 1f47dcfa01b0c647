//! The object-store scenario: a VM's memory served straight from S3 (a real S3 server,
//! s3s-fs, behind a proxy that adds first-byte latency and a bandwidth cap) beside the same
//! snapshot served from a local file.
//!
//! The snapshot: `size` bytes (1 GiB), every word distinct and incompressible, pushed with
//! `store::push`. Its working set: `ws_fraction` of memory (10%) in runs of `ws_run` bytes
//! at random places, read in a random order; recorded as the page server records one (the
//! blocks faulted, first first). A stand-in VM (Firecracker's handshake) reads one word of
//! every page of its working set, then of all its memory, checking each.
//!
//! Variants, each through one in-process `serve::Server` with one prefetch thread (the
//! product's default):
//! - `file`: the memory file on local disk (in the page cache, read through before each
//!   round), in the server's blocks (`block_bytes`);
//! - `file+ws`: the same, its working set (in its blocks) prefetched first, as `cold+ws`'s
//!   is: the baseline for the working set's goal;
//! - `cold L`: from the store at first-byte latency L, an empty frame cache;
//! - `warm L`: the same, every frame in the cache already;
//! - `cold+ws L`: cold, the recorded working set prefetched first;
//! - `vms N L`: N VMs of the snapshot at once, cold, each reading its working set (faults
//!   alone): GETs per frame read.
//!
//! Before each round's timed part, the memory its VMs will take is touched once
//! (`run::rebacked`: this host takes freed memory back a second or two after it is freed,
//! and the warm variant's fill of its cache, seconds long, otherwise handed its timed part
//! the host's first touches), and the warm variant's cache is synced to disk (else the
//! kernel writes 1 GiB back during the timed part, on the same two CPUs). Each round's
//! cache is kept until the run ends, where the disk has room (see `Lab::round`).
//!
//! Reported per variant: seconds until the working set is read and until all memory is;
//! the demand-miss latency the engine saw (faults that had to bring their block in: p50,
//! p99); GETs and bytes fetched when the working set was read, and in all. Once per run:
//! push throughput, bytes stored for the full push, and for a diff with `diff_fraction`
//! (5%) of its pages rewritten, scattered.

mod config;
mod cpu;
mod proxy;
mod report;
mod result;
mod workload;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use guestmem::restore::FaultClass;
use guestmem::serve::{Listener, MemoryFile, Server, ServerConfig, Socket};
use guestmem::store::{
    Client, FetchPolicy, FrameCache, Frames, PushConfig, PushSource, StoreMemory, StoreUrl,
};
use guestmem_testkit::firecracker::{Standin, PAGE};
use guestmem_testkit::s3::S3Server;

use crate::error::LabError;
use crate::report::LabResult;
use crate::run::{summarise, thp_mode, RunInfo};

pub use config::ObjectStoreLabConfig;
pub use cpu::CpuSplit;
pub use proxy::Proxy;
pub use result::{PushFigures, StoreFindings, StoreSample, StoreVariant};
use workload::{diff_file, read_vm, working_set, VmRead};

/// The scenario's name.
pub const SCENARIO: &str = "object-store";
const BUCKET: &str = "lab";

/// The scenario's whole result.
pub type ObjectStoreResult = LabResult<ObjectStoreLabConfig, StoreFindings>;

fn err(what: impl std::fmt::Display) -> LabError {
    LabError::restore(what.to_string())
}

/// A client of the lab's bucket at `endpoint`.
fn client(s3: &S3Server, endpoint: &str) -> Result<Arc<Client>, LabError> {
    let env: Vec<(&str, String)> = s3.env();
    let endpoint = endpoint.to_string();
    let get = move |k: &str| -> Option<String> {
        if k == "AWS_ENDPOINT_URL" {
            return Some(endpoint.clone());
        }
        env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())
    };
    Ok(Arc::new(Client::connect_with(BUCKET, &get).map_err(err)?))
}

/// Everything a round needs.
struct Lab<'a> {
    cfg: &'a ObjectStoreLabConfig,
    s3: &'a S3Server,
    mem: PathBuf,
    url: StoreUrl,
    runs: Vec<u64>,
    proxies: Vec<(u64, Proxy)>,
    /// Keep each round's folder until the run ends (see `round`), and how many so far.
    keep_rounds: bool,
    rounds: std::cell::Cell<u64>,
}

/// How a variant serves.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    File,
    FileWs,
    Cold,
    Warm,
    ColdWs,
    Many,
}

impl Lab<'_> {
    fn round(&self, kind: Kind, latency_ms: u64) -> Result<StoreSample, LabError> {
        let cfg = self.cfg;
        // A round's folder, with the frame cache its server filled, stays until the run
        // ends where the disk has room: its disk's work does not fall on the next round.
        // (When the cache made a file a frame, on this project's ext4 without a journal,
        // removing a GiB of them made each file the next round made cost 0.4-1.2 ms
        // instead of 0.06 ms: the inode allocator looks up each inode freed lately.)
        let n = self.rounds.replace(self.rounds.get() + 1);
        let dir = cfg.work_dir.join(format!("round-{n}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(err)?;
        let frames = if matches!(kind, Kind::File | Kind::FileWs) {
            None
        } else {
            let proxy = &self
                .proxies
                .iter()
                .find(|(l, _)| *l == latency_ms)
                .expect("a proxy")
                .1;
            let cache = Arc::new(FrameCache::open(&dir.join("cache"), 4 * cfg.size).map_err(err)?);
            let f = Frames::new(
                client(self.s3, &proxy.endpoint())?,
                Some(cache),
                FetchPolicy::default(),
            );
            if kind == Kind::Warm {
                // Every frame in the cache first (straight from the server: not timed).
                let direct = Frames::new(
                    client(self.s3, &self.s3.endpoint())?,
                    f.cache().cloned(),
                    FetchPolicy::default(),
                );
                StoreMemory::open(direct, &self.url)
                    .map_err(err)?
                    .fetch_all(8)
                    .map_err(err)?;
                // Its files on disk before the timed part, as a cache filled earlier has
                // them: not written back by the kernel's threads on this host's two CPUs
                // while the VM reads.
                let d = std::fs::File::open(dir.join("cache")).map_err(err)?;
                // SAFETY: syncfs takes any open descriptor; `d` is open.
                unsafe { libc::syncfs(std::os::fd::AsRawFd::as_raw_fd(&d)) };
            }
            Some(f)
        };
        let memory = match &frames {
            None => MemoryFile::open(&self.mem).map_err(err)?,
            Some(f) => {
                MemoryFile::from_store(StoreMemory::open(Arc::clone(f), &self.url).map_err(err)?)
            }
        };
        let bb = cfg.block_bytes;
        // As the page server records it: the blocks the VM faulted (a store snapshot's block
        // is its frame), first first.
        let file = matches!(kind, Kind::File | Kind::FileWs);
        let unit = if file { bb } else { cfg.frame_bytes };
        let working_set: Vec<u64> = if matches!(kind, Kind::ColdWs | Kind::FileWs) {
            let mut seen = std::collections::HashSet::new();
            self.runs
                .iter()
                .flat_map(|&r| (r / unit * unit..r + cfg.ws_run).step_by(unit as usize))
                .filter(|b| seen.insert(*b))
                .collect()
        } else {
            Vec::new()
        };
        let socket = dir.join("uffd.sock");
        let server = Server::new(
            vec![Socket {
                listener: Listener::bind(&socket).map_err(err)?,
                memory,
                working_set,
            }],
            ServerConfig {
                handler_threads: cfg.pool,
                prefetch_threads: usize::from(kind != Kind::Many),
                block_bytes: bb,
                regain_huge: false,
                ..ServerConfig::default()
            },
        )
        .map_err(err)?;
        let status = server.status();
        let drainer = server.drainer();
        let sup = std::thread::Builder::new()
            .name("guestmem-serve".into())
            .spawn(move || server.run())
            .map_err(err)?;
        let n = if kind == Kind::Many { cfg.vms } else { 1 };
        let mut vms: Vec<Standin> = (0..n)
            .map(|_| Standin::new(&[cfg.size as usize], false).map_err(err))
            .collect::<Result<_, _>>()?;
        // Where the CPUs go until the working set is read and until all is.
        let cpu = cpu::Windows::new().map_err(err)?;
        let counts = || {
            if std::env::var("GUESTMEM_LAB_PERF_PHASE").is_ok_and(|p| p == "ws") {
                // A profile of the working set's reading alone.
                crate::run::profile_window(false);
            }
            let s = status.snapshot();
            if kind != Kind::Many {
                // Many VMs read nothing else: their window ends with the round.
                cpu.working_set_read();
            }
            s.store.map_or((0, 0), |st| (st.gets, st.bytes_fetched))
        };
        // The memory its VMs are about to take, backed by this machine's host again: a
        // variant with a long set-up (the warm cache's fill) would otherwise pay its host's
        // first touches in its timed part (`run::rebacked`). The many VMs read their working
        // sets alone: that much each, not 20 GiB of a 24 GiB host. A cold cache takes as much
        // again in the page cache, for the frames its writers keep (each a fresh page for
        // the host to back: with these first touches left in, the writers' copies took 14%
        // of both CPUs in a profile of a cold run).
        let ws_bytes = self.runs.len() as u64 * cfg.ws_run;
        let taken = match kind {
            Kind::Many => n as u64 * ws_bytes,
            _ => cfg.size,
        };
        let cached = match kind {
            Kind::File | Kind::FileWs | Kind::Warm => 0,
            Kind::Cold | Kind::ColdWs => cfg.size,
            Kind::Many => ws_bytes,
        };
        if matches!(kind, Kind::File | Kind::FileWs) {
            // In the page cache, as the result says the file is: read through once outside
            // the timed part (kept rounds' caches, up to tens of GiB, may have pushed it out).
            let mut f = std::fs::File::open(&self.mem).map_err(err)?;
            let mut buf = vec![0u8; 4 << 20];
            while std::io::Read::read(&mut f, &mut buf).map_err(err)? > 0 {}
        }
        crate::run::rebacked((taken + cached) as usize + (256 << 20));
        crate::run::profile_window(true);
        let cpu_start = cpu.start();
        let t0 = Instant::now();
        for vm in &mut vms {
            vm.connect(&socket).map_err(err)?;
        }
        let reads: Vec<Result<VmRead, String>> = std::thread::scope(|s| {
            let hs: Vec<_> = vms
                .iter()
                .map(|vm| {
                    let counts = &counts;
                    let runs = &self.runs;
                    // The VM's own waits: many VMs', and one VM's that nothing is
                    // prefetched for (its misses as it sees them, beside the page server's).
                    let stalls_by =
                        matches!(kind, Kind::Many | Kind::Cold).then_some(cfg.frame_bytes);
                    let read = move || {
                        read_vm(
                            vm,
                            runs,
                            cfg.ws_run,
                            kind != Kind::Many,
                            t0,
                            counts,
                            stalls_by,
                        )
                    };
                    // Named: its time is the VM's in `cpu`.
                    std::thread::Builder::new()
                        .name("vm-reader".into())
                        .spawn_scoped(s, read)
                })
                .collect();
            hs.into_iter()
                .map(|h| match h {
                    Ok(h) => h.join().unwrap_or_else(|_| Err("a reader panicked".into())),
                    Err(e) => Err(format!("a reader's thread: {e}")),
                })
                .collect()
        });
        let (cpu_ws, cpu_all) = cpu.end(&cpu_start);
        crate::run::profile_window(false);
        let end = status.snapshot();
        for vm in &mut vms {
            vm.disconnect();
        }
        drainer.drain();
        let report = sup
            .join()
            .map_err(|_| err("the server panicked"))?
            .map_err(err)?;
        drop(vms);
        let reads: Vec<VmRead> = reads.into_iter().collect::<Result<_, _>>().map_err(err)?;
        let miss = end
            .sockets
            .first()
            .map(|k| k.fault_latency.class(FaultClass::File).clone())
            .unwrap_or_default();
        // The VMs' own waits at their first touch of each frame (p50, p99, count), every
        // VM's together, nearest rank; none where they were not timed.
        let vm_waits = {
            let mut all: Vec<f64> = reads.iter().flat_map(|r| r.stalls_us.clone()).collect();
            all.sort_by(f64::total_cmp);
            let q = |f: f64| {
                all.get(((f * all.len() as f64).ceil() as usize).saturating_sub(1))
                    .copied()
                    .unwrap_or(0.0)
            };
            (!all.is_empty()).then(|| (q(0.50), q(0.99), all.len() as u64))
        };
        // One VM: its misses' quantiles as the page server measured them (the histogram's
        // bucket holding a p99 near 30 ms spans 29.8 to 33.6 ms, and the goal is 30); many:
        // each VM's own wait at its first touch of each frame, all VMs' together (the page
        // server's clock starts when a fault thread reads the fault, and 20 VMs' faults
        // queue for its 2 threads before that).
        // (p50, p99, count), as measured.
        let exact: Option<(f64, f64, u64)> = match end.sessions.as_slice() {
            [one] if kind != Kind::Many => {
                let e = &one.engine.file_fault_exact;
                Some((e.p50_us, e.p99_us, miss.count))
            }
            _ if kind == Kind::Many => vm_waits,
            _ => None,
        };
        let _ = report;
        let (gets, bytes) = end
            .store
            .as_ref()
            .map_or((0, 0), |s| (s.gets, s.bytes_fetched));
        let slowest = |f: fn(&VmRead) -> Duration| {
            reads.iter().map(f).max().unwrap_or_default().as_secs_f64()
        };
        let frames_read = {
            let fb = cfg.frame_bytes;
            let mut f: Vec<u64> = self
                .runs
                .iter()
                .flat_map(|&r| r / fb..(r + cfg.ws_run).div_ceil(fb))
                .collect();
            f.sort_unstable();
            f.dedup();
            if kind == Kind::Many {
                f.len() as u64
            } else {
                cfg.size / fb
            }
        };
        // Its frames are written to its cache (a `Frames` dropped waits for them) before its
        // folder goes or is synced: nothing of this round lands in the next one's cache, or
        // is written back by the kernel during its timed part.
        drop((frames, status));
        match self.keep_rounds {
            true => {
                if let Ok(d) = std::fs::File::open(&dir) {
                    // SAFETY: syncfs takes any open descriptor; `d` is open.
                    unsafe { libc::syncfs(std::os::fd::AsRawFd::as_raw_fd(&d)) };
                }
            }
            false => {
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
        Ok(StoreSample {
            ws_secs: slowest(|r| r.ws),
            all_secs: if kind == Kind::Many {
                0.0
            } else {
                slowest(|r| r.all)
            },
            miss_p50_us: exact.map_or(miss.p50_us, |e| e.0),
            miss_p99_us: exact.map_or(miss.p99_us, |e| e.1),
            miss_exact: exact.is_some(),
            misses: exact.map_or(miss.count, |e| e.2),
            vm_wait_p50_us: vm_waits.map_or(0.0, |w| w.0),
            vm_wait_p99_us: vm_waits.map_or(0.0, |w| w.1),
            vm_waits: vm_waits.map_or(0, |w| w.2),
            gets_at_ws: reads.iter().map(|r| r.at_ws.0).max().unwrap_or(0),
            bytes_at_ws: reads.iter().map(|r| r.at_ws.1).max().unwrap_or(0),
            gets,
            bytes,
            frames_read,
            cpu_ws: Some(CpuSplit {
                vm: reads.iter().map(|r| r.cpu.0).sum(),
                ..cpu_ws
            }),
            cpu_all: (kind != Kind::Many).then(|| CpuSplit {
                vm: reads.iter().map(|r| r.cpu.1).sum(),
                ..cpu_all
            }),
        })
    }
}

/// Runs the scenario; writes nothing but its scratch files (removed afterwards).
pub fn run_object_store(cfg: &ObjectStoreLabConfig) -> Result<ObjectStoreResult, LabError> {
    cfg.protocol.validate(SCENARIO)?;
    if cfg.size == 0
        || !cfg.size.is_multiple_of(1 << 20)
        || cfg.ws_run == 0
        || !cfg.ws_run.is_multiple_of(PAGE as u64)
    {
        return Err(LabError::Config {
            scenario: SCENARIO,
            reason: "the size must be a multiple of 1 MiB, the working set's runs of 4 KiB".into(),
        });
    }
    crate::run::in_work_dir(&cfg.work_dir, || run_in(cfg))
}

fn run_in(cfg: &ObjectStoreLabConfig) -> Result<ObjectStoreResult, LabError> {
    let run = RunInfo::collect(cfg.command.clone());
    let mem = guestmem_testkit::firecracker::memory_file(&cfg.work_dir, cfg.size as usize, None);
    // In the scratch folder: gone with it, however the run ends.
    let s3 =
        S3Server::try_start_niced(&cfg.work_dir, "lab-object-store", &[BUCKET], cfg.store_nice)
            .map_err(err)?;
    let url = StoreUrl::parse(&format!("s3://{BUCKET}/base"), false).map_err(err)?;
    let direct = client(&s3, &s3.endpoint())?;
    let push_cfg = PushConfig {
        frame_bytes: cfg.frame_bytes,
        ..PushConfig::default()
    };
    let full = guestmem::store::push(&direct, &PushSource::Raw(mem.clone()), &url, &push_cfg)
        .map_err(err)?;
    let diff = cfg.work_dir.join("diff");
    let changed = diff_file(&diff, cfg.size, cfg.diff_fraction)?;
    let d = guestmem::store::push(
        &direct,
        &PushSource::RawDiff {
            path: diff.clone(),
            base: url.clone(),
        },
        &url.sibling("diff"),
        &push_cfg,
    )
    .map_err(err)?;
    let _ = std::fs::remove_file(&diff);
    let proxies = cfg
        .latencies_ms
        .iter()
        .map(|&l| {
            Ok((
                l,
                Proxy::start(s3.addr(), Duration::from_millis(l), cfg.bandwidth).map_err(err)?,
            ))
        })
        .collect::<Result<Vec<_>, LabError>>()?;
    // What the store delivers through the first proxy with 16 and with 64 GETs at once
    // (no cache: not what this host's disk keeps). A GET's time at a given number at once
    // bounds what that many deliver; 64 is more than read-ahead keeps in flight (48).
    let fetch_all = |threads: usize| -> Result<f64, LabError> {
        let Some((_, p)) = proxies.first() else {
            return Ok(0.0);
        };
        let f = Frames::new(client(&s3, &p.endpoint())?, None, FetchPolicy::default());
        let m = StoreMemory::open(f, &url).map_err(err)?;
        let t = Instant::now();
        m.fetch_all(threads).map_err(err)?;
        Ok(t.elapsed().as_secs_f64())
    };
    let fetch_all_secs = fetch_all(16)?;
    let fetch_all_64_secs = fetch_all(64)?;
    let push = PushFigures {
        full_secs: full.wall_secs,
        full_stored: full.bytes_stored,
        diff_changed: changed,
        diff_stored: d.bytes_stored,
        diff_secs: d.wall_secs,
        fetch_all_secs,
        fetch_all_64_secs,
    };
    let mut variants: Vec<(String, Kind, u64)> = vec![
        ("file".into(), Kind::File, 0),
        ("file+ws".into(), Kind::FileWs, 0),
    ];
    for &l in &cfg.latencies_ms {
        variants.push((format!("cold {l}ms"), Kind::Cold, l));
        variants.push((format!("warm {l}ms"), Kind::Warm, l));
        variants.push((format!("cold+ws {l}ms"), Kind::ColdWs, l));
        variants.push((format!("vms {} {l}ms", cfg.vms), Kind::Many, l));
    }
    variants.retain(|(n, _, _)| {
        cfg.only.is_empty() || cfg.only.iter().any(|o| n.starts_with(o.as_str()))
    });
    // Every round's cache kept: at most the whole snapshot a round and variant, plus a
    // snapshot's room to spare.
    let rounds = (cfg.protocol.warmup + cfg.protocol.rounds) as u64;
    let need = (rounds * variants.len() as u64 + 1).saturating_mul(cfg.size);
    let lab = Lab {
        cfg,
        s3: &s3,
        mem,
        url,
        runs: working_set(cfg),
        proxies,
        keep_rounds: crate::run::free_bytes(&cfg.work_dir).is_some_and(|f| f >= need),
        rounds: std::cell::Cell::new(0),
    };
    let samples = cfg.protocol.run(variants.len(), |i| {
        let (_, kind, l) = &variants[i];
        lab.round(*kind, *l)
    })?;
    let body = variants
        .iter()
        .zip(samples)
        .map(|((n, _, _), samples)| StoreVariant {
            name: n.clone(),
            ws_secs: summarise(&samples, |s| s.ws_secs),
            all_secs: summarise(&samples, |s| s.all_secs),
            samples,
        })
        .collect();
    Ok(LabResult {
        scenario: SCENARIO.into(),
        seeds: Vec::new(),
        run,
        settings: ObjectStoreLabConfig {
            thp_mode: thp_mode(),
            ..cfg.clone()
        },
        timed: "from the VM's connect (server listening, manifest read) until it has read its \
                working set, and until it has read all its memory; one word a page, each checked"
            .into(),
        body: StoreFindings {
            ws_bytes: lab.runs.len() as u64 * cfg.ws_run,
            push,
            variants: body,
            rounds_kept: lab.keep_rounds,
        },
    })
}
