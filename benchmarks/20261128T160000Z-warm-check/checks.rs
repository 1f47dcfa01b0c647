use std::time::Instant;
const P: u64 = 0x9E37_79B1_85EB_CA87;
fn cur(d: &[u8]) -> u64 { let mut l=[1u64,2,3,4,5,6,7,8]; for s in d.chunks_exact(64){ for (i,lane) in l.iter_mut().enumerate(){ let w=u64::from_le_bytes(s[i*8..i*8+8].try_into().unwrap()); *lane=(*lane^w).wrapping_mul(P).rotate_left(29);} } l.iter().fold(0,|a,b|a^b) }
fn main(){
  let n=256<<10; let b:Vec<u8>=(0..n).map(|i| (i*7+(i>>9)) as u8).collect();
  let mut s=0u64;
  let fs: Vec<(&str, Box<dyn Fn(&[u8])->u64>)> = vec![
    ("block hasher", Box::new(cur)),
    ("twox xxh3_64", Box::new(|d| twox_hash::XxHash3_64::oneshot(d))),
    ("xxhash-rust xxh3", Box::new(|d| xxhash_rust::xxh3::xxh3_64(d))),
    ("crc-fast crc64nvme", Box::new(|d| crc_fast::checksum(crc_fast::CrcAlgorithm::Crc64Nvme, d))),
    ("crc-fast crc32c", Box::new(|d| crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, d))),
    ("blake3", Box::new(|d| blake3::hash(d).as_bytes()[0] as u64)),
    ("zstd -1 compress", Box::new(|d| zstd::bulk::compress(d, 1).unwrap().len() as u64)),
    ("crc32fast", Box::new(|d| crc32fast::hash(d) as u64)),
    ("crc32c crate", Box::new(|d| crc32c::crc32c(d) as u64)),
  ];
  for (name,f) in &fs { let mut best=f64::MAX; for _ in 0..300 { let t=Instant::now(); s=s.wrapping_add(f(&b)); let e=t.elapsed().as_secs_f64(); if e<best{best=e} } println!("{name:20} {:.1} us  {:.1} GB/s", best*1e6, n as f64/best/1e9); }
  // streaming twox
  let mut best=f64::MAX; for _ in 0..300 { let t=Instant::now(); let mut h=twox_hash::XxHash3_64::with_seed(0); for c in b.chunks(64<<10){ use std::hash::Hasher; h.write(c);} use std::hash::Hasher; s=s.wrapping_add(h.finish()); let e=t.elapsed().as_secs_f64(); if e<best{best=e} } println!("{:20} {:.1} us", "twox streaming", best*1e6);
  println!("{s}");
}
