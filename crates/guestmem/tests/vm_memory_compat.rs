//! A real generic vm-memory consumer, virtio-queue, running over a guestmem map unchanged.

use guestmem::vm_memory::{Address, Bytes, GuestAddressSpace};
use guestmem::{GuestAddress, GuestMap, RegionSpec};
use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::{Queue, QueueT, Reader, Writer};

const VRING_DESC_F_NEXT: u16 = 1;
const VRING_DESC_F_WRITE: u16 = 2;
const MIB: u64 = 1 << 20;

/// A device that echoes its request, upper-cased, into the chain's writable part.
fn serve<M: guestmem::vm_memory::GuestMemory>(queue: &mut Queue, mem: &M) -> usize {
    let mut served = 0;
    while let Some(chain) = queue.pop_descriptor_chain(mem) {
        let head = chain.head_index();
        let mut reader = Reader::new(mem, chain.clone()).unwrap();
        let mut writer = Writer::new(mem, chain).unwrap();
        let mut req = vec![0u8; reader.available_bytes()];
        std::io::Read::read_exact(&mut reader, &mut req).unwrap();
        let resp: Vec<u8> = req.iter().map(u8::to_ascii_uppercase).collect();
        std::io::Write::write_all(&mut writer, &resp).unwrap();
        queue
            .add_used(mem, head, writer.bytes_written() as u32)
            .unwrap();
        served += 1;
    }
    served
}

#[test]
fn virtio_queue_runs_over_translator_and_snapshot() {
    // Rings in one region, buffers in a second region with a hole between them.
    let map = GuestMap::from_specs(&[
        RegionSpec::new(GuestAddress(0), MIB),
        RegionSpec::new(GuestAddress(0x100_0000), 2 * MIB),
    ])
    .unwrap();
    let t = map.translator();
    let request = b"hello from the guest driver";
    let req_addr = GuestAddress(0x100_1000);
    let resp_addr = GuestAddress(0x110_0000);
    t.write_in_region(req_addr, request).unwrap();

    let vq = MockSplitQueue::new(&t, 16);
    let descs = [
        RawDescriptor::from(SplitDescriptor::new(req_addr.0, request.len() as u32, 0, 0)),
        RawDescriptor::from(SplitDescriptor::new(resp_addr.0, 64, VRING_DESC_F_WRITE, 0)),
    ];
    vq.build_desc_chain(&descs).unwrap();
    let mut queue: Queue = vq.create_queue().unwrap();

    // The device side goes through the per-thread translator (cached find_region) ...
    assert_eq!(serve(&mut queue, &t), 1);
    let mut got = vec![0u8; request.len()];
    t.read_in_region(resp_addr, &mut got).unwrap();
    assert_eq!(got, request.to_ascii_uppercase());
    // ... and the same bytes are in the host mapping of the second region.
    let region = t.find(resp_addr).unwrap();
    let off = (resp_addr.0 - region.guest_addr().0) as usize;
    // SAFETY: off + len lies inside the 2 MiB region, which `t` keeps mapped.
    let host = unsafe { std::slice::from_raw_parts(region.host_addr().add(off), got.len()) };
    assert_eq!(host, &got[..]);
    // The used ring records the length written.
    let used_len: u32 = t.read_obj(vq.used_addr().unchecked_add(4 + 4)).unwrap();
    assert_eq!(used_len as usize, request.len());

    // A second request, served through the map's GuestAddressSpace (binary-search snapshot).
    t.write_in_region(req_addr, b"again").unwrap();
    let descs = [
        // Table slots 2 and 3, linked by hand (add_desc_chains keeps flags as given).
        RawDescriptor::from(SplitDescriptor::new(req_addr.0, 5, VRING_DESC_F_NEXT, 3)),
        RawDescriptor::from(SplitDescriptor::new(
            resp_addr.0 + 0x100,
            16,
            VRING_DESC_F_WRITE,
            0,
        )),
    ];
    vq.add_desc_chains(&descs, 2).unwrap();
    let mem = map.memory();
    assert_eq!(serve(&mut queue, &*mem), 1);
    let mut got = [0u8; 5];
    mem.read_slice(&mut got, GuestAddress(resp_addr.0 + 0x100))
        .unwrap();
    assert_eq!(&got, b"AGAIN");
}

#[test]
fn virtio_chain_into_a_hole_is_refused() {
    let map = GuestMap::from_specs(&[RegionSpec::new(GuestAddress(0), MIB)]).unwrap();
    let t = map.translator();
    let vq = MockSplitQueue::new(&t, 16);
    // The buffer points past the only region: the reader must refuse it, not touch it.
    let descs = [RawDescriptor::from(SplitDescriptor::new(
        0x800_0000, 16, 0, 0,
    ))];
    vq.build_desc_chain(&descs).unwrap();
    let mut queue: Queue = vq.create_queue().unwrap();
    let chain = queue.pop_descriptor_chain(&t).unwrap();
    assert!(Reader::new(&t, chain).is_err());
}
