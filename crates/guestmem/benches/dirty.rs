//! Marking dirty ranges: guestmem's word-level bitmap against vm-memory's `AtomicBitmap`
//! (one sequentially consistent `fetch_or` per page).
//!
//! Each iteration marks one range of 1, 16 or 512 4 KiB pages at a moving, page-aligned
//! offset inside a 1 GiB region's bitmap, so both bitmaps do the same work on cache-warm
//! words. Run: `cargo bench -p guestmem --bench dirty -- --warm-up-time 1 --measurement-time 3`.

use std::hint::black_box;
use std::num::NonZeroUsize;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use guestmem::dirty::DirtyBitmap;
use vm_memory::bitmap::AtomicBitmap;

const REGION_BYTES: u64 = 1 << 30;
const PAGE: u64 = 4096;
/// Offsets cycle through this many positions (odd pages, so ranges straddle words).
const POSITIONS: u64 = 61;

fn mark(c: &mut Criterion) {
    let mut g = c.benchmark_group("mark");
    let ours = DirtyBitmap::new(REGION_BYTES, PAGE).unwrap();
    let theirs = AtomicBitmap::new(
        REGION_BYTES as usize,
        NonZeroUsize::new(PAGE as usize).unwrap(),
    );
    for pages in [1u64, 16, 512] {
        let len = pages * PAGE;
        g.throughput(Throughput::Elements(pages));
        let offset = |i: u64| (i % POSITIONS) * 1031 * PAGE;
        g.bench_with_input(BenchmarkId::new("guestmem-word", pages), &len, |b, &len| {
            let mut i = 0;
            b.iter(|| {
                i += 1;
                ours.mark(black_box(offset(i)), black_box(len)).unwrap();
            })
        });
        g.bench_with_input(
            BenchmarkId::new("vm-memory-AtomicBitmap", pages),
            &len,
            |b, &len| {
                let mut i = 0;
                b.iter(|| {
                    i += 1;
                    theirs.set_addr_range(black_box(offset(i) as usize), black_box(len as usize));
                })
            },
        );
    }
    g.finish();
}

fn iterate(c: &mut Criterion) {
    // Walking the set pages of a 1 GiB bitmap with 1% of pages dirty, in runs of 8.
    let b = DirtyBitmap::new(REGION_BYTES, PAGE).unwrap();
    let pages = REGION_BYTES / PAGE;
    for start in (0..pages).step_by(800) {
        b.mark(start * PAGE, 8 * PAGE).unwrap();
    }
    let words = b.snapshot();
    c.bench_function("iterate/1GiB-1pct", |bench| {
        bench.iter(|| guestmem::dirty::DirtyPages::new(black_box(&words)).count())
    });
}

criterion_group!(benches, mark, iterate);
criterion_main!(benches);
