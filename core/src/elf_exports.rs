//! Which of some names an ELF shared object defines in its dynamic symbol table: how the
//! daemon tells a CUDA driver by what it exports (`cuInit`) whatever its file is named
//! (a renamed copy mapped beside the real one is a second driver, ADR 0055). Pure: the
//! caller reads the file (`read_at`), once per object; only ELF64 little-endian objects
//! with section headers are read (every Linux x86-64 and arm64 driver build).

/// At most this much of `.dynsym` or its string table is read (larger: not judged).
pub const MAX_TABLE: u64 = 64 << 20;

const SHT_DYNSYM: u32 = 11;
const SHN_UNDEF: u16 = 0;
const EHDR: usize = 64;
const SHDR: usize = 64;
const SYM: usize = 24;

/// Why an object's exports could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ElfError {
    /// Not an ELF64 little-endian file.
    #[error("not an ELF64 little-endian object")]
    NotElf64,
    /// A header or table lies outside what could be read.
    #[error("truncated ELF object: {0} unreadable")]
    Truncated(&'static str),
    /// No `.dynsym` section (a stripped section table, or not a shared object).
    #[error("no dynamic symbol table")]
    NoDynsym,
    /// `.dynsym` or its strings larger than [`MAX_TABLE`].
    #[error("dynamic symbol table of {0} bytes is larger than the {MAX_TABLE} read")]
    TooLarge(u64),
}

fn u16_at(b: &[u8], o: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(o..o + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], o: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(o..o + 4)?.try_into().ok()?))
}

fn u64_at(b: &[u8], o: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(o..o + 8)?.try_into().ok()?))
}

/// For each of `names`, whether the object defines it (a dynamic symbol with a section:
/// exported, not merely imported). `read_at(offset, len)` returns exactly `len` bytes of
/// the file at `offset`, or `None`.
pub fn defines(
    mut read_at: impl FnMut(u64, usize) -> Option<Vec<u8>>,
    names: &[&str],
) -> Result<Vec<bool>, ElfError> {
    let ehdr = read_at(0, EHDR).ok_or(ElfError::NotElf64)?;
    if ehdr.get(..6) != Some(&[0x7f, b'E', b'L', b'F', 2, 1][..]) {
        return Err(ElfError::NotElf64);
    }
    let shoff = u64_at(&ehdr, 0x28).ok_or(ElfError::NotElf64)?;
    let shentsize = usize::from(u16_at(&ehdr, 0x3a).ok_or(ElfError::NotElf64)?);
    let shnum = usize::from(u16_at(&ehdr, 0x3c).ok_or(ElfError::NotElf64)?);
    if shoff == 0 || shnum == 0 || shentsize < SHDR {
        return Err(ElfError::NoDynsym);
    }
    let table = read_at(shoff, shentsize * shnum).ok_or(ElfError::Truncated("section headers"))?;
    let section = |i: usize| table.get(i * shentsize..i * shentsize + SHDR);
    let dynsym = (0..shnum)
        .filter_map(section)
        .find(|s| u32_at(s, 4) == Some(SHT_DYNSYM))
        .ok_or(ElfError::NoDynsym)?;
    let (sym_off, sym_size) = (
        u64_at(dynsym, 24).unwrap_or(0),
        u64_at(dynsym, 32).unwrap_or(0),
    );
    let link = u32_at(dynsym, 40).unwrap_or(0) as usize;
    let strtab = section(link).ok_or(ElfError::Truncated("string table header"))?;
    let (str_off, str_size) = (
        u64_at(strtab, 24).unwrap_or(0),
        u64_at(strtab, 32).unwrap_or(0),
    );
    for size in [sym_size, str_size] {
        if size > MAX_TABLE {
            return Err(ElfError::TooLarge(size));
        }
    }
    let syms = read_at(sym_off, sym_size as usize).ok_or(ElfError::Truncated(".dynsym"))?;
    let strs = read_at(str_off, str_size as usize).ok_or(ElfError::Truncated(".dynstr"))?;
    let mut found = vec![false; names.len()];
    for sym in syms.chunks_exact(SYM) {
        if u16_at(sym, 6) == Some(SHN_UNDEF) {
            continue;
        }
        let Some(start) = u32_at(sym, 0).map(|n| n as usize) else {
            continue;
        };
        let Some(rest) = strs.get(start..) else {
            continue;
        };
        let name = &rest[..rest.iter().position(|b| *b == 0).unwrap_or(rest.len())];
        for (i, n) in names.iter().enumerate() {
            if name == n.as_bytes() {
                found[i] = true;
            }
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal ELF64 LE object: null section, .dynsym, .dynstr; `syms` are (name,
    /// defined).
    fn object(syms: &[(&str, bool)]) -> Vec<u8> {
        let mut strs = vec![0u8];
        let mut table = vec![0u8; SYM]; // the null symbol
        for (name, defined) in syms {
            let mut s = vec![0u8; SYM];
            s[0..4].copy_from_slice(&(strs.len() as u32).to_le_bytes());
            s[4] = 0x12; // global function
            s[6..8].copy_from_slice(&(if *defined { 9u16 } else { 0 }).to_le_bytes());
            table.extend(s);
            strs.extend(name.as_bytes());
            strs.push(0);
        }
        let sym_off = EHDR as u64;
        let str_off = sym_off + table.len() as u64;
        let shoff = str_off + strs.len() as u64;
        let mut f = vec![0u8; EHDR];
        f[..6].copy_from_slice(&[0x7f, b'E', b'L', b'F', 2, 1]);
        f[0x28..0x30].copy_from_slice(&shoff.to_le_bytes());
        f[0x3a..0x3c].copy_from_slice(&(SHDR as u16).to_le_bytes());
        f[0x3c..0x3e].copy_from_slice(&3u16.to_le_bytes());
        f.extend(&table);
        f.extend(&strs);
        f.extend(vec![0u8; SHDR]);
        let mut sh = |ty: u32, off: u64, size: u64, link: u32| {
            let mut s = vec![0u8; SHDR];
            s[4..8].copy_from_slice(&ty.to_le_bytes());
            s[24..32].copy_from_slice(&off.to_le_bytes());
            s[32..40].copy_from_slice(&size.to_le_bytes());
            s[40..44].copy_from_slice(&link.to_le_bytes());
            f.extend(s);
        };
        sh(SHT_DYNSYM, sym_off, table.len() as u64, 2);
        sh(3, str_off, strs.len() as u64, 0);
        f
    }

    fn reader(f: &[u8]) -> impl FnMut(u64, usize) -> Option<Vec<u8>> + '_ {
        |o, n| f.get(o as usize..o as usize + n).map(<[u8]>::to_vec)
    }

    #[test]
    fn a_defined_export_is_found_and_an_import_is_not() {
        let f = object(&[("cuInit", true), ("dlsym", false), ("cuMemAlloc_v2", true)]);
        assert_eq!(
            defines(
                reader(&f),
                &["cuInit", "dlsym", "cuMemAlloc", "cuMemAlloc_v2"]
            ),
            Ok(vec![true, false, false, true])
        );
    }

    #[test]
    fn what_is_not_an_elf64_object_is_said() {
        assert_eq!(
            defines(reader(b"#!/bin/sh\n"), &["cuInit"]),
            Err(ElfError::NotElf64)
        );
        let mut f = object(&[("cuInit", true)]);
        f.truncate(f.len() - 10);
        assert_eq!(
            defines(reader(&f), &["cuInit"]),
            Err(ElfError::Truncated("section headers"))
        );
        let mut f = object(&[("cuInit", true)]);
        f[0x3c] = 0;
        assert_eq!(defines(reader(&f), &["cuInit"]), Err(ElfError::NoDynsym));
        // Garbage after a valid header never panics.
        for cut in 0..object(&[]).len() {
            let mut g = object(&[("x", true)]);
            g.truncate(cut);
            let _ = defines(reader(&g), &["x"]);
        }
    }
}
