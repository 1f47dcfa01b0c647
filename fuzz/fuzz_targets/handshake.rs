//! Fuzzes the page server's handshake parser with what a peer could send: any bytes must
//! give regions that hold together or a clear error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(regions) = guestmem::serve::parse_regions(data) {
        for r in &regions {
            assert!(r.size > 0 && r.size % r.page_size == 0);
            assert!(r.base_host_virt_addr.checked_add(r.size).is_some());
            assert!(r.offset.checked_add(r.size).is_some());
        }
    }
});
