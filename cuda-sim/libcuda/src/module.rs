//! Modules from PTX text, their functions, and the kernel cost model.
//!
//! The simulator cannot execute PTX. It parses every `.entry` (name and parameter
//! sizes) so that modules load and functions resolve as on a real driver, and gives each
//! launch a device time from a documented cost model. Two built-in kernels do exactly
//! what tests need:
//! - `vgpu_sim_spin(.u64 ns)`: occupies the GPU for `ns` nanoseconds of device time;
//! - `vgpu_sim_fill_u32(.u64 ptr, .u32 value, .u64 count)`: writes `count` 32-bit words.

use vgpu_cuda_abi::cuda::*;

use crate::handle::{CuResult, Kind, new_handle};

/// Name of the built-in spin kernel.
pub const SPIN: &str = "vgpu_sim_spin";
/// Name of the built-in fill kernel.
pub const FILL: &str = "vgpu_sim_fill_u32";

/// A loaded module (or library).
#[derive(Debug)]
pub struct Module {
    /// Handle.
    pub id: u64,
    /// Context it was loaded in (0 for libraries).
    pub ctx: u64,
    /// Its functions' handles, in PTX order.
    pub funcs: Vec<(String, u64)>,
    /// PTX ISA version ×10 (e.g. 80 for `.version 8.0`).
    pub ptx_version: i32,
}

/// A kernel entry point.
#[derive(Debug)]
pub struct Function {
    /// Handle.
    pub id: u64,
    /// Owning module.
    pub module: u64,
    /// Entry name.
    pub name: String,
    /// Sizes of the parameters, in bytes.
    pub params: Vec<usize>,
    /// PTX ISA version ×10.
    pub ptx_version: i32,
}

/// One parsed `.entry`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Name.
    pub name: String,
    /// Parameter sizes.
    pub params: Vec<usize>,
}

fn strip_comments(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
            i += 2;
            while i + 1 < b.len() && !(b[i] == b'*' && b[i + 1] == b'/') {
                i += 1;
            }
            i += 2;
        } else {
            out.push(b[i] as char);
            i += 1;
        }
    }
    out
}

fn type_size(t: &str) -> Option<usize> {
    let t = t.trim_start_matches('.');
    let bits: usize = t.get(1..)?.parse().ok()?;
    matches!(t.as_bytes().first(), Some(b'u' | b's' | b'b' | b'f'))
        .then_some(bits / 8)
        .filter(|&n| matches!(n, 1 | 2 | 4 | 8 | 16))
}

fn param_size(p: &str) -> Option<usize> {
    let toks: Vec<&str> = p.split_whitespace().collect();
    if toks.first() != Some(&".param") {
        return None;
    }
    let ty = toks.iter().skip(1).find_map(|t| type_size(t))?;
    let last = toks.last()?;
    let count = match (last.find('['), last.find(']')) {
        (Some(a), Some(b)) if b > a + 1 => last[a + 1..b].parse::<usize>().ok()?,
        _ => 1,
    };
    ty.checked_mul(count)
}

/// Parses PTX text: every `.entry` with its parameter sizes, and the ISA version.
pub fn parse_ptx(text: &str) -> CuResult<(Vec<Entry>, i32)> {
    let text = strip_comments(text);
    let version = text
        .split(".version")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|v| {
            let (a, b) = v.split_once('.')?;
            Some(a.parse::<i32>().ok()? * 10 + b.parse::<i32>().ok()?)
        })
        .ok_or(CUDA_ERROR_INVALID_PTX)?;
    if !text.contains(".target") {
        return Err(CUDA_ERROR_INVALID_PTX);
    }
    let mut entries = Vec::new();
    let mut rest = text.as_str();
    while let Some(pos) = rest.find(".entry") {
        let after = &rest[pos + ".entry".len()..];
        let name: String = after
            .trim_start()
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '$' | '%'))
            .collect();
        if name.is_empty() {
            return Err(CUDA_ERROR_INVALID_PTX);
        }
        let after_name = &after.trim_start()[name.len()..];
        let mut params = Vec::new();
        let body_start = after_name.find('{').ok_or(CUDA_ERROR_INVALID_PTX)?;
        let head = &after_name[..body_start];
        if let (Some(a), Some(b)) = (head.find('('), head.rfind(')')) {
            for p in head[a + 1..b]
                .split(',')
                .map(str::trim)
                .filter(|p| !p.is_empty())
            {
                params.push(param_size(p).ok_or(CUDA_ERROR_INVALID_PTX)?);
            }
        }
        entries.push(Entry { name, params });
        rest = &after_name[body_start..];
    }
    Ok((entries, version))
}

/// Checks a module image and parses it. Only PTX text is accepted: the simulator has
/// no binary for cubins or fatbins.
pub fn parse_image(image: &[u8]) -> CuResult<(Vec<Entry>, i32)> {
    if image.starts_with(b"\x7fELF") || image.starts_with(&0xBA55_ED50u32.to_le_bytes()) {
        return Err(CUDA_ERROR_NO_BINARY_FOR_GPU);
    }
    let end = image.iter().position(|&b| b == 0).unwrap_or(image.len());
    let text = std::str::from_utf8(&image[..end]).map_err(|_| CUDA_ERROR_INVALID_IMAGE)?;
    parse_ptx(text)
}

/// Builds module and function objects from parsed entries.
pub fn build(ctx: u64, entries: Vec<Entry>, ptx_version: i32) -> (Module, Vec<Function>) {
    let id = new_handle(Kind::Module);
    let funcs: Vec<Function> = entries
        .into_iter()
        .map(|e| Function {
            id: new_handle(Kind::Func),
            module: id,
            name: e.name,
            params: e.params,
            ptx_version,
        })
        .collect();
    let module = Module {
        id,
        ctx,
        funcs: funcs.iter().map(|f| (f.name.clone(), f.id)).collect(),
        ptx_version,
    };
    (module, funcs)
}

/// Launch geometry.
#[derive(Debug, Clone, Copy)]
pub struct Geometry {
    /// Grid dimensions.
    pub grid: [u32; 3],
    /// Block dimensions.
    pub block: [u32; 3],
    /// Dynamic shared memory.
    pub shared: u32,
}

/// Validates a launch configuration as the hardware limits do.
pub fn check_geometry(g: &Geometry) -> CuResult<()> {
    let [gx, gy, gz] = g.grid;
    let [bx, by, bz] = g.block;
    if gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if gx > i32::MAX as u32 || gy > 65535 || gz > 65535 || bx > 1024 || by > 1024 || bz > 64 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if u64::from(bx) * u64::from(by) * u64::from(bz) > 1024 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if g.shared > 227 * 1024 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(())
}

/// Device time of a generic kernel: 2 µs launch latency plus 1 µs per wave, a wave being
/// as many blocks as the device holds at once (2048 resident threads per SM).
pub fn cost_ns(g: &Geometry, sm_count: u32) -> u64 {
    let blocks = u64::from(g.grid[0]) * u64::from(g.grid[1]) * u64::from(g.grid[2]);
    let threads = u64::from(g.block[0]) * u64::from(g.block[1]) * u64::from(g.block[2]);
    let per_sm = (2048 / threads.max(1)).clamp(1, 32);
    let resident = per_sm * u64::from(sm_count.max(1));
    2_000 + blocks.div_ceil(resident) * 1_000
}

/// Whether a cooperative launch of `g` fits on the device at once.
pub fn cooperative_fits(g: &Geometry, sm_count: u32) -> bool {
    let blocks = u64::from(g.grid[0]) * u64::from(g.grid[1]) * u64::from(g.grid[2]);
    let threads = u64::from(g.block[0]) * u64::from(g.block[1]) * u64::from(g.block[2]);
    let per_sm = (2048 / threads.max(1)).clamp(1, 32);
    blocks <= per_sm * u64::from(sm_count.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    const PTX: &str = r#"
    // a comment with .entry fake(
    .version 8.0
    .target sm_90
    .address_size 64
    .visible .entry vgpu_sim_spin(
        .param .u64 vgpu_sim_spin_param_0
    )
    { ret; }
    /* block
       comment */
    .visible .entry add(.param .u64 .ptr .global .align 4 a, .param .u32 n, .param .align 8 .b8 s[24])
    { ret; }
    .entry noargs { ret; }
    "#;

    #[test]
    fn parses_entries_and_params() {
        let (e, v) = parse_ptx(PTX).expect("valid ptx");
        assert_eq!(v, 80);
        assert_eq!(e.len(), 3);
        assert_eq!(
            e[0],
            Entry {
                name: "vgpu_sim_spin".into(),
                params: vec![8]
            }
        );
        assert_eq!(
            e[1],
            Entry {
                name: "add".into(),
                params: vec![8, 4, 24]
            }
        );
        assert_eq!(
            e[2],
            Entry {
                name: "noargs".into(),
                params: vec![]
            }
        );
    }

    #[test]
    fn rejects_non_ptx() {
        assert_eq!(
            parse_image(b"\x7fELF\x02\x01").unwrap_err(),
            CUDA_ERROR_NO_BINARY_FOR_GPU
        );
        assert_eq!(parse_image(b"hello").unwrap_err(), CUDA_ERROR_INVALID_PTX);
        assert_eq!(
            parse_image(b".version 8.0\n.target sm_90\n.entry (").unwrap_err(),
            CUDA_ERROR_INVALID_PTX
        );
    }

    #[test]
    fn geometry_limits() {
        let ok = Geometry {
            grid: [1, 1, 1],
            block: [1024, 1, 1],
            shared: 0,
        };
        assert!(check_geometry(&ok).is_ok());
        assert!(
            check_geometry(&Geometry {
                block: [1025, 1, 1],
                ..ok
            })
            .is_err()
        );
        assert!(
            check_geometry(&Geometry {
                block: [32, 32, 2],
                ..ok
            })
            .is_err()
        );
        assert!(
            check_geometry(&Geometry {
                grid: [0, 1, 1],
                ..ok
            })
            .is_err()
        );
        assert_eq!(
            cost_ns(
                &Geometry {
                    grid: [132 * 2, 1, 1],
                    block: [1024, 1, 1],
                    shared: 0
                },
                132
            ),
            3_000
        );
        assert!(cooperative_fits(
            &Geometry {
                grid: [264, 1, 1],
                block: [1024, 1, 1],
                shared: 0
            },
            132
        ));
        assert!(!cooperative_fits(
            &Geometry {
                grid: [265, 1, 1],
                block: [1024, 1, 1],
                shared: 0
            },
            132
        ));
    }
}
