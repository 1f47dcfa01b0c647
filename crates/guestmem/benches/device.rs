//! What a device pays to write guest memory through the device view, with and without dirty
//! tracking, beside vm-memory's `GuestMemoryMmap` with and without its `AtomicBitmap`.
//!
//! - `write_obj_u64`: one `Bytes::write_obj::<u64>` at a moving address in a 64 MiB region
//!   (a used-ring update, a descriptor's status byte): lookup, slice, store, and for the
//!   tracked variants one mark.
//! - `mark_512_pages`: the marking a 2 MiB (512-page) `write_slice` does after its copy, as
//!   vm-memory does it: `mark_dirty` on the region slice's bitmap.
//!
//! Run: `cargo bench -p guestmem --bench device -- --warm-up-time 1 --measurement-time 3`.

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion};
use guestmem::vm_memory::bitmap::{AtomicBitmap, Bitmap};
use guestmem::vm_memory::{
    Bytes, GuestMemory, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion, MemoryRegionAddress,
};
use guestmem::{DirtyTracking, GuestAddress, GuestMap, RegionSpec};

const REGION_BYTES: u64 = 64 << 20;
const SLICE_BYTES: usize = 2 << 20;

/// A moving, 8-byte aligned address that lands on a different page each time.
fn addr(i: u64) -> GuestAddress {
    GuestAddress((i.wrapping_mul(4099 * 8) % (REGION_BYTES - 8)) & !7)
}

fn write<M: GuestMemory>(
    c: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    mem: &M,
) {
    let mut i = 0u64;
    c.bench_function(BenchmarkId::new(name, "u64"), |b| {
        b.iter(|| {
            i += 1;
            mem.write_obj(black_box(i), addr(i)).unwrap();
        })
    });
}

fn bench(c: &mut Criterion) {
    let map = |dirty| {
        GuestMap::from_specs(&[
            RegionSpec::new(GuestAddress(0), REGION_BYTES).with_dirty_tracking(dirty)
        ])
        .unwrap()
    };
    let plain = map(DirtyTracking::Off);
    let tracked = map(DirtyTracking::On);
    let ranges = [(GuestAddress(0), REGION_BYTES as usize)];
    let vmm: GuestMemoryMmap<()> = GuestMemoryMmap::from_ranges(&ranges).unwrap();
    let vmm_bitmap: GuestMemoryMmap<AtomicBitmap> = GuestMemoryMmap::from_ranges(&ranges).unwrap();
    // Fault everything in first: the bench measures the access path, not first touches.
    for m in [&plain, &tracked] {
        m.view()
            .write_slice(&vec![1u8; REGION_BYTES as usize], GuestAddress(0))
            .unwrap();
    }
    vmm.write_slice(&vec![1u8; REGION_BYTES as usize], GuestAddress(0))
        .unwrap();
    vmm_bitmap
        .write_slice(&vec![1u8; REGION_BYTES as usize], GuestAddress(0))
        .unwrap();

    let mut g = c.benchmark_group("write_obj");
    write(&mut g, "guestmem-untracked", &*plain.view());
    write(&mut g, "guestmem-tracked", &*tracked.view());
    write(&mut g, "guestmem-tracked-translator", &tracked.translator());
    write(&mut g, "vm-memory", &vmm);
    write(&mut g, "vm-memory-AtomicBitmap", &vmm_bitmap);
    g.finish();

    let mut g = c.benchmark_group("mark_512_pages");
    let snap = tracked.view();
    let ours = snap.regions()[0].clone();
    let theirs = vmm_bitmap.find_region(GuestAddress(0)).unwrap();
    let offset = |i: u64| MemoryRegionAddress((i % 31) * SLICE_BYTES as u64);
    let mut i = 0u64;
    g.bench_function(BenchmarkId::new("guestmem-word", 512), |b| {
        b.iter(|| {
            i += 1;
            let s = ours.get_slice(offset(i), SLICE_BYTES).unwrap();
            s.bitmap().mark_dirty(0, black_box(SLICE_BYTES));
        })
    });
    g.bench_function(BenchmarkId::new("vm-memory-AtomicBitmap", 512), |b| {
        b.iter(|| {
            i += 1;
            let s = theirs.get_slice(offset(i), SLICE_BYTES).unwrap();
            s.bitmap().mark_dirty(0, black_box(SLICE_BYTES));
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
