//! The Rust mirrors in `vgpu_ebpf::abi` match the C compiler's layout of bpf/vgpu_ebpf.h:
//! sizes, offsets and constants are read from `vgpu_layout` in the compiled layout.bpf.o.

#![allow(clippy::unwrap_used)] // test code: a failed read is the failure

use std::mem::{offset_of, size_of};

use object::{Object, ObjectSection, ObjectSymbol};
use vgpu_ebpf::abi::*;

fn c_layout() -> Vec<u64> {
    let path = concat!(env!("OUT_DIR"), "/layout.bpf.o");
    let data = std::fs::read(path).expect("build.rs compiled layout.bpf.o");
    let file = object::File::parse(&*data).expect("an ELF object");
    let symbol = file
        .symbols()
        .find(|s| s.name() == Ok("vgpu_layout"))
        .expect("vgpu_layout");
    let section = file
        .section_by_index(symbol.section_index().expect("defined"))
        .unwrap();
    let bytes = section.data().unwrap();
    let start = usize::try_from(symbol.address() - section.address()).unwrap();
    let end = start + usize::try_from(symbol.size()).unwrap();
    bytes[start..end]
        .chunks_exact(8)
        .map(|chunk| u64::from_le_bytes(chunk.try_into().unwrap()))
        .collect()
}

#[test]
fn rust_types_match_the_c_header() {
    let size = |n: usize| n as u64;
    let field = |offset: usize, len: usize| [offset as u64, len as u64];
    let mut rust = vec![u64::from(ABI_VERSION), size(size_of::<DevKey>())];
    rust.extend(field(offset_of!(DevKey, major), 4));
    rust.extend(field(offset_of!(DevKey, minor), 4));
    rust.push(size(size_of::<RawEvent>()));
    rust.extend(field(offset_of!(RawEvent, kind), 4));
    rust.extend(field(offset_of!(RawEvent, tgid), 4));
    rust.extend(field(offset_of!(RawEvent, pid), 4));
    rust.extend(field(offset_of!(RawEvent, major), 4));
    rust.extend(field(offset_of!(RawEvent, minor), 4));
    rust.extend(field(offset_of!(RawEvent, access), 4));
    rust.extend(field(offset_of!(RawEvent, cgroup_id), 8));
    rust.extend(field(offset_of!(RawEvent, time_ns), 8));
    rust.extend(field(offset_of!(RawEvent, comm), 16));
    rust.extend(
        [
            CONFIG_MODE,
            CONFIG_ABI,
            CONFIG_LEN,
            MODE_ENFORCE,
            MODE_AUDIT,
        ]
        .map(u64::from),
    );
    rust.extend([ANY_MINOR, MAJORS].map(u64::from));
    rust.extend(
        [
            COUNTER_LOST,
            COUNTER_REFUSED,
            COUNTER_AUDITED,
            COUNTER_EXITS,
            COUNTER_EXIT_LOST,
            COUNTER_LEN,
        ]
        .map(u64::from),
    );
    rust.extend([EVENT_REFUSED, EVENT_AUDITED, EVENT_EXIT].map(u64::from));
    assert_eq!(c_layout(), rust);
}
