//! The `guestmem` command: thin glue over the guestmem library.
fn main() {
    println!("guestmem {}", env!("CARGO_PKG_VERSION"));
}
