//! The shim ↔ daemon protocol (compute time-slicing), shared by `libvgpu.so` and
//! `vgpu-daemon`. No I/O here: framing and message types only.
//!
//! Transport: a unix stream socket (`VGPU_DAEMON_SOCKET`). Each frame is a 4-byte
//! little-endian length followed by that many bytes of JSON (one [`ShimMsg`] or
//! [`DaemonMsg`], externally tagged). Frames are at most [`MAX_FRAME`] bytes; a longer
//! length, bad JSON or an unknown message is a protocol error and the daemon closes that
//! connection (and only that one).
//!
//! Versioning: the first frame on a connection is [`ShimMsg::Hello`] carrying
//! [`PROTO_VERSION`]; the daemon answers [`DaemonMsg::Welcome`] (with the board file
//! descriptor attached as `SCM_RIGHTS`) or [`DaemonMsg::Refused`]. Fields may be added
//! (readers ignore unknown fields and default missing optional ones); any change of
//! meaning bumps the version, and a daemon answers a version it does not speak with
//! `Refused`, after which the shim runs its local fallback.
//!
//! Liveness (additive): a daemon that sets `peer_checks` in its [`DaemonMsg::Welcome`] answers
//! [`ShimMsg::Ping`] with [`DaemonMsg::Pong`] and accepts [`ShimMsg::Fallback`]; a shim
//! sends either only to such a daemon (an older one would close the connection on an
//! unknown message). The shim bounds every wait on the daemon with a deadline
//! ([`HANDSHAKE_DEADLINE_MS`], [`PEER_DEADLINE_MS`]) and runs its local fallback when one
//! passes.
//!
//! Admission (additive): before its driver opens a GPU device node (`cuInit`,
//! `nvmlInit*`), the shim sends [`ShimMsg::Admit`] alone on a short connection; the daemon
//! lets the process (by its peer credentials) through its eBPF device gate and answers
//! [`DaemonMsg::Admitted`]. A daemon without the message closes the connection; the shim
//! then goes on (the gate, if any, decides).
//!
//! The grant itself is not a message on the fast path: the daemon writes each tenant's
//! grant word in a shared memory page (the "board", one page per tenant, sealed so the
//! tenant can only map it read-only). Word `i` (a `u32` at byte offset
//! `i * BOARD_STRIDE`) belongs to the tenant's `i`-th GPU of its `Hello`; its value is
//! `generation << 1 | held` ([`GrantWord`], the one packer and unpacker). Launchers read it with one atomic load and wait on it with
//! a futex when not held.
//!
//! Claims (additive, ADR 0030): a daemon may attach a second descriptor to its
//! `Welcome`, the tenant's "claim page" (one page, writable by the tenant's processes,
//! size-sealed). Word `i` of it (same offset as the grant word) is where a launcher
//! stores the grant word it is about to launch under, the first time it launches under
//! that grant, and then reads the grant word again (both sequentially consistent). The
//! daemon stores a revocation in the grant word and then reads the claim: one of the two
//! sees the other's store, so a claim that does not name the revoked grant means no
//! process launched under it, and the GPU goes on without waiting for the tenant's
//! drain report (which a tenant whose container its CPU limit stopped sends only when it
//! runs again). A shim that ignores the page (or a tenant that scribbles on it) is
//! charged what it reports it ran, as before. Just before its claim a launcher stores
//! the time (CLOCK_MONOTONIC ns, a `u64` at [`CLAIM_TIME_OFFSET`] in the word's
//! stride): how long after the grant the tenant started, which the daemon's slices
//! follow (additive: 0 from an older shim, not read by an older daemon).
//!
//! Expiry (additive, ADR 0036): beside a grant word the board may say when that grant
//! ends without word from the daemon: the generation it is for (a `u32` at
//! [`EXPIRY_GEN_OFFSET`] in the word's stride) and the time (CLOCK_MONOTONIC ns, a `u64`
//! at [`EXPIRY_AT_OFFSET`]; 0: none). The daemon sets it to the holder's slice end plus
//! a margin (longer when nobody waits, and moved on at each renewal): a shim still
//! holding that grant then yields it as if revoked (a daemon starved of CPU, or frozen,
//! otherwise left the holder the GPU for as long as it did not run). Written as a sequence lock: the
//! generation [`EXPIRY_WRITING`], the time, then the generation; a reader takes the
//! time only between two reads of the same generation, the one it holds. An older
//! shim ignores it; an older daemon leaves it 0.

use serde::{Deserialize, Serialize};

/// Most lines of [`ContainerIdent::overridden`] a daemon accepts.
pub const MAX_OVERRIDDEN: usize = 8;
/// Longest line of [`ContainerIdent::overridden`] a daemon accepts, bytes.
pub const MAX_OVERRIDDEN_LEN: usize = 512;
/// Protocol version spoken by this build.
pub const PROTO_VERSION: u32 = 1;
/// Largest frame body, bytes.
pub const MAX_FRAME: usize = 64 * 1024;
/// Bytes between two grant words of the board (one cache line each).
pub const BOARD_STRIDE: usize = 64;
/// Offset, within a claim word's stride, of the time of the claim (a `u64`,
/// CLOCK_MONOTONIC ns, stored before the claim word).
pub const CLAIM_TIME_OFFSET: usize = 8;
/// Offset, within a grant word's stride of the board, of its grant's expiry time (a
/// `u64`, CLOCK_MONOTONIC ns; 0: none). See "Expiry" above.
pub const EXPIRY_AT_OFFSET: usize = 8;
/// Offset, within a grant word's stride of the board, of the generation its expiry is
/// for (a `u32`).
pub const EXPIRY_GEN_OFFSET: usize = 16;
/// The expiry's generation while the daemon writes its time (no generation is this:
/// generations have 31 bits).
pub const EXPIRY_WRITING: u32 = u32::MAX;
/// Most GPUs one process may register.
pub const MAX_GPUS: usize = 16;
/// Size of a board, bytes (one page).
pub const BOARD_BYTES: usize = 4096;
/// The board word the daemon gives a GPU it does not schedule for this process (one the
/// container was not granted): the last word of the page, never written, so never held.
pub const NEVER_HELD_WORD: u32 = (BOARD_BYTES / BOARD_STRIDE - 1) as u32;
/// Longest the shim waits for the daemon's answer to its `Hello` (connect, send, the
/// whole `Welcome`), ms: a frozen, slow or dribbling daemon costs at most this.
pub const HANDSHAKE_DEADLINE_MS: u64 = 1000;
/// Longest a registered shim with blocked launches waits without hearing anything from
/// the daemon (it sends a [`ShimMsg::Ping`] meanwhile), ms; then it falls back.
pub const PEER_DEADLINE_MS: u64 = 2000;
/// Longest `reason` of a [`ShimMsg::Fallback`], bytes (longer ones are cut).
pub const MAX_REASON: usize = 256;

/// One grant word of the board, unpacked: bit 0 is `held`, bits 1..32 the
/// `generation` (`generation << 1 | held`). The daemon packs it, the shim's launchers
/// unpack it; the shim's local fallback keeps a word of the same layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GrantWord {
    /// Which grant (or revocation) this is; only its low 31 bits fit in the word.
    pub generation: u32,
    /// Whether the GPU is granted to the tenant now.
    pub held: bool,
}

impl GrantWord {
    /// Largest generation a word carries; generations wrap to 0 after it.
    pub const MAX_GENERATION: u32 = u32::MAX >> 1;

    /// A held word of generation `generation`.
    pub const fn held(generation: u32) -> GrantWord {
        GrantWord {
            generation,
            held: true,
        }
    }

    /// The word's value (`generation << 1 | held`; a generation's bit 31 is dropped).
    pub const fn pack(self) -> u32 {
        (self.generation << 1) | self.held as u32
    }

    /// The grant a word's value says.
    pub const fn unpack(word: u32) -> GrantWord {
        GrantWord {
            generation: word >> 1,
            held: word & 1 == 1,
        }
    }

    /// The generation after `generation`, wrapped to [`GrantWord::MAX_GENERATION`].
    pub const fn next_generation(generation: u32) -> u32 {
        generation.wrapping_add(1) & Self::MAX_GENERATION
    }
}

/// How a tenant may use idle GPU time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ComputePolicy {
    /// Work-conserving: idle share goes to busy tenants.
    #[default]
    Burst,
    /// Hard ceiling at the share, even when the GPU is otherwise idle.
    Cap,
}

/// Priority class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum Priority {
    /// Best-effort (batch, training).
    #[default]
    BestEffort,
    /// Latency-sensitive (inference, interactive): preempts best-effort slices.
    LatencySensitive,
}

impl std::str::FromStr for ComputePolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "burst" => Ok(Self::Burst),
            "cap" => Ok(Self::Cap),
            _ => Err(format!(
                "unknown compute policy {s:?} (expected burst or cap)"
            )),
        }
    }
}

impl std::fmt::Display for ComputePolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Burst => "burst",
            Self::Cap => "cap",
        })
    }
}

impl std::str::FromStr for Priority {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "best-effort" | "low" => Ok(Self::BestEffort),
            "latency-sensitive" | "high" => Ok(Self::LatencySensitive),
            _ => Err(format!(
                "unknown priority {s:?} (expected best-effort or latency-sensitive)"
            )),
        }
    }
}

impl std::fmt::Display for Priority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::BestEffort => "best-effort",
            Self::LatencySensitive => "latency-sensitive",
        })
    }
}

/// Compute settings of one tenant on one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ComputeSettings {
    /// Share of the GPU's time, percent (1–100).
    pub share_pct: u32,
    /// Burst or cap.
    #[serde(default)]
    pub policy: ComputePolicy,
    /// Priority class.
    #[serde(default)]
    pub priority: Priority,
}

impl ComputeSettings {
    /// Checks the share's range, naming the bad value.
    pub fn validate(&self) -> Result<(), String> {
        if (1..=100).contains(&self.share_pct) {
            Ok(())
        } else {
            Err(format!(
                "compute share {} % is out of range (1–100)",
                self.share_pct
            ))
        }
    }
}

/// Who a connecting process belongs to (as the shim knows it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ContainerIdent {
    /// Tenant key: processes with the same key form one tenant (one container).
    pub key: String,
    /// Pod namespace, if known.
    #[serde(default)]
    pub namespace: String,
    /// Pod name, if known.
    #[serde(default)]
    pub pod: String,
    /// Container name, if known.
    #[serde(default)]
    pub container: String,
    /// The container directory (`VGPU_CONTAINER_DIR`) as seen inside the container; with
    /// the container's fixed quota file (ADR 0042), its fixed directory.
    #[serde(default)]
    pub container_dir: String,
    /// What the process's environment asked that the container's quota file overrode
    /// (ADR 0042: another `VGPU_CONTAINER_DIR`, a higher `VGPU_MEMORY_LIMIT`, …), one line
    /// each, for the daemon to report. Additive: absent (empty) from older shims and
    /// ignored by older daemons.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub overridden: Vec<String>,
}

/// One GPU a process registers for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuRegistration {
    /// The GPU's UUID (`GPU-…`).
    pub uuid: String,
    /// Its CUDA ordinal in the process.
    pub ordinal: u32,
    /// The settings the shim proposes (the daemon may override them).
    pub settings: ComputeSettings,
    /// Memory quota of the container on this GPU, bytes (None: unlimited).
    #[serde(default)]
    pub memory_quota: Option<u64>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// An allocation the shim refused because it would have taken the container over its
/// memory quota on one GPU (or the container has no quota there: `quota` 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct MemoryRefusal {
    /// Bytes the allocation asked for (rounded to the driver's granularity).
    pub asked: u64,
    /// Bytes the container had charged on the GPU when it was refused.
    pub used: u64,
    /// The container's quota on the GPU, bytes.
    pub quota: u64,
}

/// Shim → daemon.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ShimMsg {
    /// First frame: who this process is and which GPUs it uses.
    Hello {
        /// [`PROTO_VERSION`].
        proto: u32,
        /// The process's own view of its PID (informational; the daemon uses the peer
        /// credentials of the socket).
        pid: u32,
        /// The container.
        ident: ContainerIdent,
        /// Its GPUs, board word `i` for `gpus[i]`.
        gpus: Vec<GpuRegistration>,
    },
    /// A launcher of this process is blocked on GPU `gpu` (index into `gpus`).
    Demand {
        /// GPU index.
        gpu: u32,
        /// CLOCK_MONOTONIC ns when the launcher blocked: a daemon starved of CPU reads
        /// the frame late, and must not take the wait for a sleep (which would forfeit
        /// time the tenant is owed). The daemon believes it only within
        /// `MAX_DEMAND_AGE_NS` of when it reads it. Additive: absent from older shims.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        since_ns: Option<u64>,
    },
    /// The grant `generation` on `gpu` was revoked (or expired, `expired`) and this
    /// process's work has drained.
    Drained {
        /// GPU index.
        gpu: u32,
        /// The generation revoked.
        generation: u32,
        /// CLOCK_MONOTONIC ns when the last work completed.
        end_ns: u64,
        /// Kernels launched under this grant.
        launches: u64,
        /// Whether launchers are still waiting (demand continues).
        waiting: bool,
        /// Device time this process's work occupied under this grant, ns, as the shim
        /// measured it (absent: not measured yet; the daemon charges the whole slice).
        /// Additive: an older daemon ignores it, an older shim does not send it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        busy_ns: Option<u64>,
        /// The process yielded the grant at its expiry (ADR 0036): the daemon had not
        /// revoked it in time. Additive: absent means false.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        expired: bool,
    },
    /// Under grant `generation` the process launched nothing for a while, stopped using the
    /// grant (a later launch asks again with [`ShimMsg::Demand`]) and its work has
    /// completed: the slice can go to someone else.
    Idle {
        /// GPU index.
        gpu: u32,
        /// The generation held.
        generation: u32,
        /// CLOCK_MONOTONIC ns when the last work completed.
        end_ns: u64,
        /// Kernels launched under this grant.
        launches: u64,
        /// Device time occupied under this grant, ns (as in [`ShimMsg::Drained`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        busy_ns: Option<u64>,
    },
    /// Memory in use by the container on `gpu` (periodic).
    Usage {
        /// GPU index.
        gpu: u32,
        /// Bytes charged to the container on this GPU.
        memory_used: u64,
        /// Allocations this process refused on `gpu` over the container's memory quota
        /// since it started (a running count). Absent from older shims: 0; older
        /// daemons ignore it.
        #[serde(default, skip_serializing_if = "is_zero")]
        refused: u64,
        /// The latest of those refusals, with its figures.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        last_refusal: Option<MemoryRefusal>,
    },
    /// Are you there? (Only to a daemon whose `Welcome` set `peer_checks`.) The daemon
    /// answers [`DaemonMsg::Pong`] with the same `seq`.
    Ping {
        /// Echoed back.
        seq: u32,
    },
    /// Sent right after the `Welcome` by a process that ran its local fallback since it
    /// last reported (only to a daemon whose `Welcome` set `peer_checks`).
    Fallback {
        /// Periods spent in local fallback since the last report.
        periods: u32,
        /// Their total length, ms.
        total_ms: u64,
        /// Why the last one began (at most [`MAX_REASON`] bytes).
        reason: String,
    },
    /// Alone on its connection, before the process's driver opens a GPU device node: let
    /// this process (the socket's peer) through the node's GPU device gate. Answered with
    /// [`DaemonMsg::Admitted`]; the connection then closes.
    Admit {
        /// [`PROTO_VERSION`].
        proto: u32,
    },
}

/// Daemon → shim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum DaemonMsg {
    /// Registration accepted; the board's file descriptor travels with this frame.
    Welcome {
        /// [`PROTO_VERSION`].
        proto: u32,
        /// The tenant this process joined.
        tenant: String,
        /// The settings in force per GPU (same order as `Hello::gpus`).
        settings: Vec<ComputeSettings>,
        /// The board word of each GPU (same order as `Hello::gpus`).
        words: Vec<u32>,
        /// Longest a grant lasts before the daemon may revoke it, µs.
        quantum_us: u64,
        /// How much work a process may queue beyond what completes, µs of GPU time: the
        /// deepest bound any grant may give (a grant names its own, at most this; ADR
        /// 0032); 0: unbounded.
        queue_ahead_us: u64,
        /// The process's PID in the daemon's (the host's) PID namespace, from the
        /// socket's credentials: NVML reports host PIDs, so a shim in a container's PID
        /// namespace maps them to its own with it. Absent from older daemons.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        host_pid: Option<u32>,
        /// Indices (into `Hello::gpus`) of GPUs the daemon does not schedule for this
        /// process: the container was not granted them. Their word is
        /// [`NEVER_HELD_WORD`]; a launch there can never be granted. Absent: none.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        not_granted: Vec<u32>,
        /// This daemon answers [`ShimMsg::Ping`] and accepts [`ShimMsg::Fallback`].
        /// Absent from older daemons.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        peer_checks: bool,
    },
    /// Registration refused (bad version, bad settings): the shim falls back.
    Refused {
        /// Why, naming the bad value.
        reason: String,
    },
    /// The tenant holds `gpu` under generation `generation` (the board word already says so).
    Grant {
        /// GPU index.
        gpu: u32,
        /// Generation.
        generation: u32,
        /// This grant's queue-ahead bound, µs, at most the Welcome's: deeper for a holder
        /// slow to start and to report (ADR 0032), tighter for a best-effort holder
        /// beside latency-sensitive tenants (it drains faster when preempted). None: the
        /// Welcome's.
        #[serde(default)]
        queue_ahead_us: Option<u64>,
    },
    /// The grant `generation` on `gpu` ended: stop launching (the board word already says so),
    /// drain, answer [`ShimMsg::Drained`].
    Revoke {
        /// GPU index.
        gpu: u32,
        /// Generation.
        generation: u32,
    },
    /// New settings for `gpu` (live change): used by the shim's fallback.
    Settings {
        /// GPU index.
        gpu: u32,
        /// Settings in force.
        settings: ComputeSettings,
    },
    /// The answer to [`ShimMsg::Ping`].
    Pong {
        /// The ping's `seq`.
        seq: u32,
    },
    /// The answer to [`ShimMsg::Admit`].
    Admitted {
        /// Whether a device gate runs on this node and took the process (`false`: no gate,
        /// nothing to do).
        gate: bool,
    },
}

/// A framing or decoding error.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FrameError {
    /// The length prefix exceeds [`MAX_FRAME`].
    #[error("frame of {0} bytes exceeds the {MAX_FRAME}-byte limit")]
    TooLong(usize),
    /// The body is not a valid message.
    #[error("malformed message: {0}")]
    Malformed(String),
}

/// Encodes one frame (length prefix + JSON).
pub fn encode<T: Serialize>(msg: &T) -> Vec<u8> {
    let body = serde_json::to_vec(msg).expect("plain enums always serialize");
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&u32::try_from(body.len()).unwrap_or(u32::MAX).to_le_bytes());
    out.extend_from_slice(&body);
    out
}

/// Takes one complete frame off the front of `buf`, if there is one.
///
/// `Ok(None)`: more bytes are needed. On `Ok(Some(_))` the frame's bytes have been
/// removed from `buf`.
pub fn decode<T: for<'de> Deserialize<'de>>(buf: &mut Vec<u8>) -> Result<Option<T>, FrameError> {
    let Some(head) = buf.get(..4) else {
        return Ok(None);
    };
    let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
    if len > MAX_FRAME {
        return Err(FrameError::TooLong(len));
    }
    if buf.len() < 4 + len {
        return Ok(None);
    }
    let msg = serde_json::from_slice(&buf[4..4 + len])
        .map_err(|e| FrameError::Malformed(e.to_string()))?;
    buf.drain(..4 + len);
    Ok(Some(msg))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_refusal_fields_are_optional_both_ways() {
        // An older shim's report: no refusals.
        let old: ShimMsg =
            serde_json::from_str(r#"{"Usage":{"gpu":1,"memory_used":5}}"#).expect("parses");
        assert_eq!(
            old,
            ShimMsg::Usage {
                gpu: 1,
                memory_used: 5,
                refused: 0,
                last_refusal: None
            }
        );
        // Without refusals a newer shim writes what an older daemon reads.
        let plain = serde_json::to_string(&old).expect("serializes");
        assert_eq!(plain, r#"{"Usage":{"gpu":1,"memory_used":5}}"#);
        // With them: the figures travel.
        let r = ShimMsg::Usage {
            gpu: 0,
            memory_used: 3,
            refused: 2,
            last_refusal: Some(MemoryRefusal {
                asked: 1,
                used: 3,
                quota: 4,
            }),
        };
        let text = serde_json::to_string(&r).expect("serializes");
        assert_eq!(serde_json::from_str::<ShimMsg>(&text).expect("parses"), r);
    }

    #[test]
    fn grant_word_is_generation_shifted_once_with_held_in_bit_zero() {
        let g = |generation, held| GrantWord { generation, held }.pack();
        assert_eq!(g(0, false), 0);
        assert_eq!(g(0, true), 1);
        assert_eq!(g(5, true), 11);
        assert_eq!(g(6, false), 12);
        assert_eq!(g(GrantWord::MAX_GENERATION, true), u32::MAX);
        // Bit 31 of a generation does not fit: it is dropped, as a shift drops it.
        assert_eq!(g(1 << 31 | 3, false), 6);
        assert_eq!(
            GrantWord::unpack(11),
            GrantWord {
                generation: 5,
                held: true
            }
        );
        assert_eq!(
            GrantWord::unpack(u32::MAX).generation,
            GrantWord::MAX_GENERATION
        );
        assert_eq!(GrantWord::held(5).pack(), 11);
        assert_eq!(GrantWord::next_generation(4), 5);
        assert_eq!(GrantWord::next_generation(GrantWord::MAX_GENERATION), 0);
    }

    proptest::proptest! {
        #[test]
        fn grant_word_round_trips(word: u32) {
            proptest::prop_assert_eq!(GrantWord::unpack(word).pack(), word);
            let w = GrantWord::unpack(word);
            proptest::prop_assert_eq!(w.generation, word >> 1);
            proptest::prop_assert_eq!(w.held, word & 1 == 1);
        }
    }

    #[test]
    fn a_drain_report_without_busy_time_still_parses_and_none_is_not_sent() {
        let old: ShimMsg = serde_json::from_str(
            r#"{"Drained":{"gpu":0,"generation":3,"end_ns":5,"launches":2,"waiting":false}}"#,
        )
        .expect("an older shim's report");
        assert!(matches!(
            old,
            ShimMsg::Drained {
                busy_ns: None,
                expired: false,
                ..
            }
        ));
        let idle = ShimMsg::Idle {
            gpu: 0,
            generation: 3,
            end_ns: 5,
            launches: 2,
            busy_ns: None,
        };
        let text = serde_json::to_string(&idle).expect("serializable");
        assert!(!text.contains("busy_ns"), "{text}");
    }

    #[test]
    fn frames_round_trip_in_pieces() {
        let a = ShimMsg::Demand {
            gpu: 3,
            since_ns: Some(5),
        };
        let b = ShimMsg::Drained {
            gpu: 0,
            generation: 7,
            end_ns: 99,
            launches: 12,
            waiting: true,
            busy_ns: Some(40),
            expired: true,
        };
        let mut wire = encode(&a);
        wire.extend(encode(&b));
        let mut buf = Vec::new();
        let mut got = Vec::new();
        for byte in wire {
            buf.push(byte);
            while let Some(m) = decode::<ShimMsg>(&mut buf).expect("valid") {
                got.push(m);
            }
        }
        assert_eq!(got, vec![a, b]);
        assert!(buf.is_empty());
    }

    #[test]
    fn garbage_is_an_error_naming_it() {
        let mut buf = vec![0xff, 0xff, 0xff, 0x7f];
        assert_eq!(
            decode::<ShimMsg>(&mut buf),
            Err(FrameError::TooLong(0x7fff_ffff))
        );
        let mut buf = encode(&"not a message");
        assert!(matches!(
            decode::<ShimMsg>(&mut buf),
            Err(FrameError::Malformed(_))
        ));
    }

    #[test]
    fn additions_are_optional_on_the_wire() {
        // A Welcome of an older daemon (no not_granted, no peer_checks) still decodes.
        let old = r#"{"Welcome":{"proto":1,"tenant":"t","settings":[],"words":[],"quantum_us":1,"queue_ahead_us":1}}"#;
        let mut buf = Vec::new();
        buf.extend_from_slice(&u32::try_from(old.len()).expect("short").to_le_bytes());
        buf.extend_from_slice(old.as_bytes());
        match decode::<DaemonMsg>(&mut buf).expect("valid") {
            Some(DaemonMsg::Welcome {
                not_granted,
                peer_checks,
                ..
            }) => assert!(not_granted.is_empty() && !peer_checks),
            other => panic!("{other:?}"),
        }
        assert!(NEVER_HELD_WORD as usize * BOARD_STRIDE < BOARD_BYTES);
        assert!(NEVER_HELD_WORD as usize >= MAX_GPUS);
    }

    #[test]
    fn settings_parse_and_validate() {
        assert_eq!("cap".parse::<ComputePolicy>(), Ok(ComputePolicy::Cap));
        assert!(
            "max"
                .parse::<ComputePolicy>()
                .unwrap_err()
                .contains("\"max\"")
        );
        assert_eq!(
            "latency-sensitive".parse::<Priority>(),
            Ok(Priority::LatencySensitive)
        );
        let s = ComputeSettings {
            share_pct: 0,
            policy: ComputePolicy::Burst,
            priority: Priority::BestEffort,
        };
        assert!(s.validate().unwrap_err().contains("0 %"));
        let json = r#"{"share_pct":30}"#;
        let s: ComputeSettings = serde_json::from_str(json).expect("defaults");
        assert_eq!(s.policy, ComputePolicy::Burst);
        assert_eq!(s.priority, Priority::BestEffort);
    }
}
