//! What device code gets: vm-memory's `GuestMemory` over a snapshot or a translator.
//!
//! 1. It behaves exactly as vm-memory's own `GuestMemoryMmap` on the same layout: the same
//!    `Bytes` and virtio-queue operations, at region edges, across adjacent regions, into
//!    holes, with rings straddling a region boundary, give identical results.
//! 2. Except where vm-memory's types cannot keep a promise guestmem makes: a write into a
//!    read-only region is refused on every path, nothing written; a write into a region that
//!    tracks writes marks its dirty bitmap.

use std::sync::atomic::Ordering;

use guestmem::vm_memory::{Bytes, GuestMemory, GuestMemoryMmap, MemoryRegionAddress, Permissions};
use guestmem::{Access, DirtyTracking, GuestAddress, GuestMap, ReadOnlyWrite, RegionSpec};
use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::{Queue, QueueT, Reader, Writer};

const K64: u64 = 64 << 10;
const VRING_DESC_F_WRITE: u16 = 2;

/// The layouts compared: (start, size) of each region.
fn layouts() -> Vec<(&'static str, Vec<(u64, u64)>)> {
    vec![
        ("single", vec![(0, K64)]),
        ("adjacent", vec![(0, K64), (K64, K64)]),
        ("hole", vec![(0, K64), (2 * K64, K64)]),
        (
            "high",
            vec![(0x1_0000_0000 - K64, K64), (0x1_0000_0000, K64)],
        ),
    ]
}

fn guestmem_map(regions: &[(u64, u64)]) -> GuestMap {
    let specs: Vec<RegionSpec> = regions
        .iter()
        .map(|&(a, s)| RegionSpec::new(GuestAddress(a), s))
        .collect();
    GuestMap::from_specs(&specs).unwrap()
}

fn vm_memory_map(regions: &[(u64, u64)]) -> GuestMemoryMmap<()> {
    let ranges: Vec<(GuestAddress, usize)> = regions
        .iter()
        .map(|&(a, s)| (GuestAddress(a), s as usize))
        .collect();
    GuestMemoryMmap::from_ranges(&ranges).unwrap()
}

/// Deterministic bytes for an operation.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64).wrapping_mul(31).wrapping_add(seed) as u8)
        .collect()
}

/// Runs every `Bytes` operation at every interesting address and length over `mem`, and
/// records each result (values, counts, errors, bytes read) as text, then the whole content.
fn bytes_ops<M: GuestMemory>(mem: &M, regions: &[(u64, u64)]) -> Vec<String> {
    let mut addrs = vec![0u64, 1, 7, u64::MAX - 7, 1 << 40];
    for &(a, s) in regions {
        for d in [0u64, 1, 4, 8] {
            addrs.extend([
                a.wrapping_add(d),
                (a + s).wrapping_sub(d),
                (a + s).wrapping_add(d),
            ]);
        }
    }
    addrs.sort_unstable();
    addrs.dedup();
    let mut out = Vec::new();
    let mut seed = 0u64;
    for &addr in &addrs {
        let a = GuestAddress(addr);
        for len in [1usize, 4, 8, 16, 4096, K64 as usize + 16] {
            seed += 1;
            let data = pattern(len, seed);
            out.push(format!(
                "write_slice {addr:#x}+{len}: {:?}",
                mem.write_slice(&data, a)
            ));
            out.push(format!("write {addr:#x}+{len}: {:?}", mem.write(&data, a)));
            let mut buf = vec![0u8; len];
            let r = mem.read_slice(&mut buf, a);
            out.push(format!(
                "read_slice {addr:#x}+{len}: {r:?} {:x?}",
                &buf[..len.min(32)]
            ));
            let mut buf = vec![0u8; len];
            let r = mem.read(&mut buf, a);
            out.push(format!(
                "read {addr:#x}+{len}: {r:?} {:x?}",
                &buf[..len.min(32)]
            ));
            for p in [Permissions::Read, Permissions::Write] {
                out.push(format!(
                    "check_range {addr:#x}+{len} {p:?}: {}",
                    mem.check_range(a, len, p)
                ));
                let lens: Result<Vec<usize>, String> = mem
                    .get_slices(a, len, p)
                    .map_err(|e| format!("{e:?}"))
                    .and_then(|it| {
                        it.map(|s| s.map(|s| s.len()).map_err(|e| format!("{e:?}")))
                            .collect()
                    });
                out.push(format!("get_slices {addr:#x}+{len} {p:?}: {lens:?}"));
            }
        }
        out.push(format!("write_obj {addr:#x}: {:?}", mem.write_obj(seed, a)));
        out.push(format!("read_obj {addr:#x}: {:?}", mem.read_obj::<u64>(a)));
        out.push(format!(
            "store {addr:#x}: {:?}",
            mem.store(seed as u32, a, Ordering::SeqCst)
        ));
        out.push(format!(
            "load {addr:#x}: {:?}",
            mem.load::<u32>(a, Ordering::SeqCst)
        ));
    }
    for &(a, s) in regions {
        let mut all = vec![0u8; s as usize];
        mem.read_slice(&mut all, GuestAddress(a)).unwrap();
        out.push(format!("content {a:#x}: {:x?}", all));
    }
    out
}

fn assert_same(what: &str, ours: &[String], theirs: &[String]) {
    assert_eq!(ours.len(), theirs.len(), "{what}: operation count");
    for (o, t) in ours.iter().zip(theirs) {
        assert_eq!(o, t, "{what}");
    }
}

#[test]
fn bytes_operations_match_vm_memory_on_every_layout() {
    let mut checks = 0;
    for (name, regions) in layouts() {
        let theirs = bytes_ops(&vm_memory_map(&regions), &regions);
        let map = guestmem_map(&regions);
        let snap_ops = bytes_ops(&*map.view(), &regions);
        assert_same(&format!("{name} snapshot"), &snap_ops, &theirs);
        let map = guestmem_map(&regions);
        let t = map.translator();
        assert_same(
            &format!("{name} translator"),
            &bytes_ops(&t, &regions),
            &theirs,
        );
        checks += 2 * theirs.len();
    }
    println!("{checks} operation results identical to vm-memory's");
    assert!(checks > 1000);
}

/// A device serving every chain: reads the request, writes it back upper-cased, adds it to
/// the used ring; records what it saw.
fn serve<M: GuestMemory>(queue: &mut Queue, mem: &M) -> Vec<String> {
    let mut log = Vec::new();
    while let Some(chain) = queue.pop_descriptor_chain(mem) {
        let head = chain.head_index();
        let reader = Reader::new(mem, chain.clone());
        let writer = Writer::new(mem, chain);
        let (mut reader, mut writer) = match (reader, writer) {
            (Ok(r), Ok(w)) => (r, w),
            (r, w) => {
                log.push(format!(
                    "head {head}: reader {:?} writer {:?}",
                    r.err(),
                    w.err()
                ));
                queue.add_used(mem, head, 0).unwrap();
                continue;
            }
        };
        let mut req = vec![0u8; reader.available_bytes()];
        std::io::Read::read_exact(&mut reader, &mut req).unwrap();
        let resp: Vec<u8> = req.iter().map(u8::to_ascii_uppercase).collect();
        let wrote = std::io::Write::write(&mut writer, &resp);
        log.push(format!("head {head}: req {req:x?} wrote {wrote:?}"));
        queue
            .add_used(mem, head, writer.bytes_written() as u32)
            .unwrap();
    }
    log
}

/// A buffer of a chain: guest address, length, whether the device writes it.
type Buf = (u64, u32, bool);

/// A queue whose rings start at `ring`, with chains whose buffers sit at `bufs`, served
/// over `mem`; returns the device's log, then the rings' and buffers' bytes.
fn virtio_run<M: GuestMemory>(mem: &M, ring: u64, bufs: &[Buf]) -> Vec<String> {
    let vq = MockSplitQueue::create(mem, GuestAddress(ring), 16);
    for (i, &(addr, len, writable)) in bufs.iter().enumerate() {
        let _ = mem.write_slice(&pattern(len as usize, i as u64 + 0x61), GuestAddress(addr));
        let flags = if writable { VRING_DESC_F_WRITE } else { 0 };
        let descs = [RawDescriptor::from(SplitDescriptor::new(
            addr, len, flags, 0,
        ))];
        vq.add_desc_chains(&descs, i as u16).unwrap();
    }
    let mut queue: Queue = vq.create_queue().unwrap();
    let mut out = serve(&mut queue, mem);
    let mut ringbytes = vec![0u8; 16 * 16 + 64 + 4 + 8 * 16 + 8];
    out.push(format!(
        "rings {:?}",
        mem.read(&mut ringbytes, GuestAddress(ring))
    ));
    out.push(format!("{ringbytes:x?}"));
    for &(addr, len, _) in bufs {
        let mut b = vec![0u8; len as usize];
        out.push(format!(
            "buf {addr:#x}: {:?} {b:x?}",
            mem.read_slice(&mut b, GuestAddress(addr))
        ));
        let _ = &mut b;
    }
    out
}

#[test]
fn virtio_queue_matches_vm_memory_with_rings_and_buffers_across_edges() {
    let regions = vec![(0, K64), (K64, K64), (3 * K64, K64)];
    // Rings straddling the 64 KiB boundary (the used ring, then the descriptor table); buffers
    // crossing it, ending at a region's end, and running into the hole.
    let scenarios: [(u64, Vec<Buf>); 3] = [
        (
            K64 - 300,
            vec![(K64 - 10, 20, false), (2 * K64 - 8, 8, true)],
        ),
        (K64 - 128, vec![(K64 - 4, 64, true), (100, 16, false)]),
        (
            4096,
            vec![(2 * K64 - 8, 16, false), (3 * K64 + 16, 32, true)],
        ),
    ];
    for (ring, bufs) in scenarios {
        let theirs = virtio_run(&vm_memory_map(&regions), ring, &bufs);
        let map = guestmem_map(&regions);
        assert_same("snapshot", &virtio_run(&*map.view(), ring, &bufs), &theirs);
        let map = guestmem_map(&regions);
        assert_same(
            "translator",
            &virtio_run(&map.translator(), ring, &bufs),
            &theirs,
        );
    }
}

fn rom_map() -> GuestMap {
    // A read-write region, then a 64 KiB ROM right after it.
    let map = GuestMap::from_specs(&[
        RegionSpec::new(GuestAddress(0), K64),
        RegionSpec::new(GuestAddress(K64), K64).with_access(Access::ReadOnly),
    ])
    .unwrap();
    // The host loads the image through the region's own Bytes (the host's way in).
    let snap = map.view();
    snap.regions()[1]
        .write_slice(&[0xa5; 64], MemoryRegionAddress(0))
        .unwrap();
    map
}

fn assert_read_only_error(e: &guestmem::vm_memory::GuestMemoryError) {
    let msg = e.to_string();
    assert!(
        msg.contains("region 0x10000..0x20000 is read-only"),
        "{msg}"
    );
    let guestmem::vm_memory::GuestMemoryError::IOError(io) = e else {
        panic!("not an I/O error: {e:?}");
    };
    assert!(io
        .get_ref()
        .and_then(|i| i.downcast_ref::<ReadOnlyWrite>())
        .is_some());
}

fn rom_writes_refused<M: GuestMemory>(mem: &M) {
    let rom = GuestAddress(K64 + 8);
    assert_read_only_error(&mem.write(&[1; 8], rom).unwrap_err());
    assert_read_only_error(&mem.write_slice(&[1; 8], rom).unwrap_err());
    assert_read_only_error(&mem.write_obj(1u64, rom).unwrap_err());
    assert_read_only_error(&mem.store(1u32, rom, Ordering::SeqCst).unwrap_err());
    assert!(mem.get_slices(rom, 8, Permissions::Write).is_err());
    assert!(!mem.check_range(rom, 8, Permissions::Write));
    assert!(mem.check_range(rom, 8, Permissions::Read));
    // A write that starts in the read-write region and runs into the ROM: nothing written,
    // not even its read-write part.
    assert_read_only_error(&mem.write(&[2; 16], GuestAddress(K64 - 8)).unwrap_err());
    assert_read_only_error(
        &mem.write_slice(&[2; 16], GuestAddress(K64 - 8))
            .unwrap_err(),
    );
    let mut b = [0u8; 16];
    mem.read_slice(&mut b, GuestAddress(K64 - 8)).unwrap();
    assert_eq!(
        b,
        [0, 0, 0, 0, 0, 0, 0, 0, 0xa5, 0xa5, 0xa5, 0xa5, 0xa5, 0xa5, 0xa5, 0xa5]
    );
    // Reads are untouched.
    assert_eq!(mem.read_obj::<u8>(rom).unwrap(), 0xa5);
    // A virtio chain that asks the device to write into the ROM is refused by the Writer.
    let vq = MockSplitQueue::create(mem, GuestAddress(0x1000), 16);
    let descs = [RawDescriptor::from(SplitDescriptor::new(
        K64,
        32,
        VRING_DESC_F_WRITE,
        0,
    ))];
    vq.build_desc_chain(&descs).unwrap();
    let mut queue: Queue = vq.create_queue().unwrap();
    let chain = queue.pop_descriptor_chain(mem).unwrap();
    assert!(Writer::new(mem, chain).is_err());
    let mut rom_bytes = [0u8; 64];
    mem.read_slice(&mut rom_bytes, GuestAddress(K64)).unwrap();
    assert_eq!(rom_bytes, [0xa5; 64], "the ROM is unchanged");
}

#[test]
fn rom_writes_are_refused_on_every_path_and_name_the_region() {
    let map = rom_map();
    rom_writes_refused(&*map.view());
    let map = rom_map();
    rom_writes_refused(&map.translator());
}

#[test]
fn device_writes_mark_the_regions_dirty_bitmap() {
    let map = GuestMap::from_specs(&[
        RegionSpec::new(GuestAddress(0), 1 << 20).with_dirty_tracking(DirtyTracking::On),
        RegionSpec::new(GuestAddress(1 << 20), 1 << 20),
    ])
    .unwrap();
    let snap = map.view();
    let t = map.translator();
    // Through each path a device takes: Bytes on the snapshot and translator, a straddling
    // write, a virtio-queue used-ring update, and the translator's own write.
    snap.write_obj(7u64, GuestAddress(0x1008)).unwrap();
    t.write_slice(&[1; 100], GuestAddress(0x3000 - 50)).unwrap();
    t.write_in_region(GuestAddress(0x9000), &[3; 8]).unwrap();
    snap.write(&[4; 64], GuestAddress((1 << 20) - 32)).unwrap(); // straddles into region 1
    let vq = MockSplitQueue::create(&*snap, GuestAddress(0x20000), 16);
    let descs = [RawDescriptor::from(SplitDescriptor::new(
        0x40000,
        16,
        VRING_DESC_F_WRITE,
        0,
    ))];
    vq.build_desc_chain(&descs).unwrap();
    let mut queue: Queue = vq.create_queue().unwrap();
    let chain = queue.pop_descriptor_chain(&*snap).unwrap();
    let mut w = Writer::new(&*snap, chain).unwrap();
    std::io::Write::write_all(&mut w, &[5; 16]).unwrap();
    queue.add_used(&*snap, 0, 16).unwrap();

    let bitmap = snap.regions()[0].dirty_bitmap().unwrap();
    let mut words = Vec::new();
    bitmap.take(&mut words);
    let dirty: Vec<u64> = guestmem::dirty::DirtyPages::new(&words).collect();
    // Pages: 0x1 (write_obj), 0x2 and 0x3 (0x2fce..0x3032), 0x9, 0xff (last page of the
    // region), 0x40 (the buffer); the used ring at 0x20000 + table + avail lies in page 0x20.
    let used_page = vq.used_addr().0 / 4096;
    let mut want = vec![0x1, 0x2, 0x3, 0x9, 0x40, 0xff, used_page];
    // MockSplitQueue::create wrote the rings through vm-memory too (the table and avail).
    want.push(0x20);
    want.sort_unstable();
    want.dedup();
    assert_eq!(dirty, want);
    assert!(
        snap.regions()[1].dirty_bitmap().is_none(),
        "tracking is per region, opt-in"
    );
}
