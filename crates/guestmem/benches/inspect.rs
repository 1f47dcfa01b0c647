//! Bring-up's check and verify phases against the region count: both read the kernel's
//! account of every region (smaps once, numa_maps once, then each region by binary search),
//! so 8,000 regions should cost about 8x what 1,000 do, not 64x as a scan per region did.
//!
//! Each map holds N guarded 64 KiB regions of anonymous memory (3 VMAs each), populated once;
//! `check` is `limits::check` (what bring-up runs before touching memory: smaps, status,
//! pools, memlock), `verify` is `inspect::inspect` (what it runs after).
//! Run: `cargo bench -p guestmem --bench inspect -- --warm-up-time 1 --measurement-time 3`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use guestmem::{
    inspect, limits, populate, GuestAddress, GuestMap, PinStrategy, PopulateConfig, RegionSpec, Thp,
};

const REGION_BYTES: u64 = 64 << 10;
/// Guest addresses step by twice the region size, so regions never touch.
const STRIDE_BYTES: u64 = 2 * REGION_BYTES;

fn map_of(n: u64) -> GuestMap {
    let specs: Vec<RegionSpec> = (0..n)
        .map(|i| {
            RegionSpec::new(GuestAddress(i * STRIDE_BYTES), REGION_BYTES).with_thp(Thp::NoHuge)
        })
        .collect();
    let map = GuestMap::from_specs(&specs).expect("map");
    let cfg = PopulateConfig {
        pin: PinStrategy::None,
        ..PopulateConfig::default()
    };
    populate(&map.view(), &cfg).expect("populate");
    map
}

fn phases(c: &mut Criterion) {
    let mut g = c.benchmark_group("bringup-phases");
    g.sample_size(20);
    for n in [1_000u64, 8_000] {
        let map = map_of(n);
        let snap = map.view();
        g.bench_with_input(BenchmarkId::new("check", n), &n, |b, _| {
            b.iter(|| limits::check(&snap, PinStrategy::UpFront).expect("check"))
        });
        g.bench_with_input(BenchmarkId::new("verify", n), &n, |b, _| {
            b.iter(|| inspect::inspect(&snap).expect("inspect"))
        });
    }
    g.finish();
}

criterion_group!(benches, phases);
criterion_main!(benches);
