//! Lazy-restore fault serving without KVM: host threads stand in for vCPUs and touch every
//! page of their half of a 256 MiB image (no prefetch), so the figure is the handlers' own
//! rate: 1 handler thread against 2. And eager restore, 1 thread against 2.
//!
//! `cargo bench -p guestmem --bench restore`. Each iteration maps fresh memory (the host has
//! backed it before: the same sizes come back every iteration), restores, touches, finishes.

use std::path::PathBuf;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use guestmem::layout::RegionSpec;
use guestmem::restore::{restore, Prefetch, RestoreConfig, RestoreMode};
use guestmem::snapshot::{save, Image, SaveConfig};
use guestmem::vm_memory::Bytes;
use guestmem::{GuestAddress, GuestMap};

const SIZE: u64 = 256 << 20;

fn image() -> Image {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("bench-restore");
    let _ = std::fs::remove_dir_all(&dir);
    let map = GuestMap::from_specs(&[RegionSpec::new(GuestAddress(0), SIZE)]).unwrap();
    let snap = map.view();
    for p in 0..SIZE / 4096 {
        snap.write_slice(&(p as u32 + 1).to_le_bytes(), GuestAddress(p * 4096))
            .unwrap();
    }
    save(&snap, &dir, &SaveConfig::default()).unwrap();
    let image = Image::open(&dir).unwrap();
    // The page cache holds the file from here on.
    let _ = std::fs::read(image.memory_path());
    image
}

fn touch_all(map: &GuestMap, threads: u64) {
    std::thread::scope(|s| {
        for t in 0..threads {
            s.spawn(move || {
                let snap = map.view();
                let per = SIZE / threads;
                let mut b = [0u8; 4];
                for at in (t * per..(t + 1) * per).step_by(4096) {
                    snap.read_slice(&mut b, GuestAddress(at)).unwrap();
                }
            });
        }
    });
}

fn bench(c: &mut Criterion) {
    let image = image();
    let specs = image.specs();
    let mut g = c.benchmark_group("restore-256MiB");
    g.sample_size(10).measurement_time(Duration::from_secs(8));
    for handlers in [1, 2] {
        g.bench_function(format!("lazy-2-touchers-{handlers}-handlers"), |b| {
            b.iter(|| {
                let cfg = RestoreConfig {
                    mode: RestoreMode::Lazy,
                    threads: 1,
                    handler_threads: handlers,
                    prefetch: Prefetch::None,
                    ..RestoreConfig::default()
                };
                let r = restore(&image, &specs, &cfg).unwrap();
                touch_all(&r.map, 2);
                r.lazy.unwrap().finish().unwrap();
            })
        });
    }
    for threads in [1, 2] {
        g.bench_function(format!("eager-{threads}-threads"), |b| {
            b.iter(|| {
                let cfg = RestoreConfig {
                    mode: RestoreMode::Eager,
                    threads,
                    ..RestoreConfig::default()
                };
                restore(&image, &specs, &cfg).unwrap();
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
