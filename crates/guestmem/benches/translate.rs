//! Guest-address lookup: guestmem's cached translator against vm-memory's binary search.
//!
//! Two access patterns, after seed 004:
//! - `own`: a thread (a vCPU) keeps touching its own region, as each of 64 vCPUs in
//!   dirty_log_perf_test touches its own memslot. Every lookup of a batch hits one region;
//!   the batches rotate over all regions, so the cache must follow a change of region too.
//! - `random`: uniformly random addresses over all regions, the cache's worst case.
//!
//! Each measured iteration is a batch of `BATCH` lookups; Criterion's time is divided by
//! `BATCH` in the README's table.
//!
//! The `view-*` variants go through vm-memory's `GuestMemory::get_slices` (what virtio-queue
//! calls) over guestmem's device view (the snapshot, binary search; the translator, cached)
//! and over `GuestMemoryMmap`.

use criterion::measurement::WallTime;
use criterion::{
    black_box, criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion, Throughput,
};
use guestmem::vm_memory::{
    GuestMemory, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion, Permissions,
};
use guestmem::{Guard, GuestAddress, GuestMap, RegionSpec, Thp};

const BATCH: usize = 1024;
const REGION_BYTES: u64 = 2 << 20;
/// Regions are spaced with holes between them, as memslots usually are.
const STRIDE_BYTES: u64 = 4 << 20;

fn addresses(regions: u64, pattern: &str) -> Vec<Vec<GuestAddress>> {
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    match pattern {
        // One batch per region: all lookups in that region.
        "own" => (0..regions)
            .map(|r| {
                (0..BATCH)
                    .map(|_| GuestAddress(r * STRIDE_BYTES + ((next() % REGION_BYTES) & !7)))
                    .collect()
            })
            .collect(),
        _ => (0..16)
            .map(|_| {
                (0..BATCH)
                    .map(|_| {
                        let r = next() % regions;
                        GuestAddress(r * STRIDE_BYTES + ((next() % REGION_BYTES) & !7))
                    })
                    .collect()
            })
            .collect(),
    }
}

/// Times `lookup` over one batch per iteration, rotating through `batches`. Generic, so the
/// lookup is inlined into the loop as it would be in a VMM: no indirect call is measured.
fn run<F: Fn(GuestAddress)>(
    g: &mut BenchmarkGroup<'_, WallTime>,
    n: u64,
    batches: &[Vec<GuestAddress>],
    name: &str,
    lookup: F,
) {
    let mut k = 0usize;
    g.bench_function(BenchmarkId::new(name, n), |b| {
        b.iter(|| {
            let batch = &batches[k % batches.len()];
            k += 1;
            for &a in batch {
                lookup(a);
            }
        })
    });
}

fn bench(c: &mut Criterion) {
    for &n in &[1u64, 8, 64, 512] {
        let specs: Vec<RegionSpec> = (0..n)
            .map(|i| {
                RegionSpec::new(GuestAddress(i * STRIDE_BYTES), REGION_BYTES)
                    .with_thp(Thp::Default)
                    .with_guard(Guard::Off)
            })
            .collect();
        let map = GuestMap::from_specs(&specs).unwrap();
        let ranges: Vec<(GuestAddress, usize)> = (0..n)
            .map(|i| (GuestAddress(i * STRIDE_BYTES), REGION_BYTES as usize))
            .collect();
        let vmm: GuestMemoryMmap<()> = GuestMemoryMmap::from_ranges(&ranges).unwrap();
        for pattern in ["own", "random"] {
            let batches = addresses(n, pattern);
            let mut g = c.benchmark_group(format!("lookup/{pattern}"));
            g.throughput(Throughput::Elements(BATCH as u64));
            let t = map.translator();
            let snap = map.view();
            run(&mut g, n, &batches, "guestmem-translate", |a| {
                black_box(t.translate(a, 8).unwrap());
            });
            run(&mut g, n, &batches, "guestmem-find_region", |a| {
                black_box(t.find_region(a).unwrap());
            });
            run(&mut g, n, &batches, "guestmem-nocache-find_region", |a| {
                black_box(snap.find_region(a).unwrap());
            });
            run(&mut g, n, &batches, "vm-memory-get_slice", |a| {
                black_box(vmm.get_slice(a, 8).unwrap());
            });
            run(&mut g, n, &batches, "vm-memory-find_region", |a| {
                black_box(vmm.find_region(a).unwrap().start_addr());
            });
            let read = Permissions::Read;
            run(&mut g, n, &batches, "guestmem-view-snapshot", |a| {
                black_box(GuestMemory::get_slices(&*snap, a, 8, read).unwrap().next());
            });
            run(&mut g, n, &batches, "guestmem-view-translator", |a| {
                black_box(GuestMemory::get_slices(&t, a, 8, read).unwrap().next());
            });
            run(&mut g, n, &batches, "vm-memory-view", |a| {
                black_box(GuestMemory::get_slices(&vmm, a, 8, read).unwrap().next());
            });
            g.finish();
        }
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
