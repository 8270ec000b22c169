//! Suspension (issue 43, ADRs 0066 and 0070): what the shim and the daemon share to
//! resume a suspended container on its next CUDA call. No I/O here.
//!
//! The board (see [`crate::sched_proto`]) carries one more word, the tenant's
//! *suspension word*, at [`SUSPEND_OFFSET`]: `generation << 1 | suspended`, written by
//! the daemon only (the board is sealed read-only for the tenant). The daemon sets it
//! before it locks the container's processes and clears it after it unlocks them; a
//! shim reads it with one atomic load before each CUDA call it intercepts. Additive: an
//! older shim never reads it (its calls wait in the driver until an operator resumes the
//! container), an older daemon never sets it.
//!
//! A shim that finds it set asks the daemon to resume the container on a short
//! connection of its own (as `Admit` does): the first frame is [`ResumeMsg::Resume`]
//! (same framing as [`crate::sched_proto`]: [`crate::sched_proto::encode`] /
//! [`crate::sched_proto::decode`]), the daemon answers one [`ResumeAnswer`] when the
//! container runs again (or why it cannot) and closes. The daemon identifies the
//! process by the socket's peer credentials. An older daemon closes the connection on
//! the unknown frame; the shim then waits and asks again (see [`RESUME_RETRY_MS`]).

use serde::{Deserialize, Serialize};

use crate::sched_proto::{BOARD_BYTES, BOARD_STRIDE, MAX_GPUS, NEVER_HELD_WORD};

/// The board word (index, as grant words are numbered) that holds the suspension word.
pub const SUSPEND_WORD: usize = BOARD_BYTES / BOARD_STRIDE - 2;
/// Byte offset of the suspension word in the board.
pub const SUSPEND_OFFSET: usize = SUSPEND_WORD * BOARD_STRIDE;
/// Longest a shim waits for one answer to its `Resume`, ms: a restore of 80 GiB over a
/// 25 GB/s link takes 3.4 s; a daemon that says nothing for this long is asked again.
pub const RESUME_DEADLINE_MS: u64 = 60_000;
/// Time between two attempts of a shim to reach a daemon that did not answer, ms.
pub const RESUME_RETRY_MS: u64 = 200;
/// Longest a shim asks a daemon it cannot reach (no socket, no answer) before its call
/// goes on into the driver, ms: a daemon restarted within it resumes the container (it
/// restores a process the driver holds checkpointed even without its books); after it,
/// the driver decides (a process still locked waits there for a controller).
pub const RESUME_ABSENT_MS: u64 = 30_000;

const _: () = assert!(SUSPEND_WORD >= MAX_GPUS && SUSPEND_WORD != NEVER_HELD_WORD as usize);

/// Whether a suspension word says the container is suspended (or being suspended).
pub const fn is_suspended(word: u32) -> bool {
    word & 1 == 1
}

/// The next value of a suspension word whose value is `word`, saying `suspended`: the
/// generation moves on at every change (futex waiters see a new value).
pub const fn next_word(word: u32, suspended: bool) -> u32 {
    ((word >> 1).wrapping_add(1) << 1) | suspended as u32
}

/// The shim's request, the first and only frame of its connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ResumeMsg {
    /// Resume the container of the connecting process.
    Resume {
        /// [`crate::sched_proto::PROTO_VERSION`] of the shim.
        proto: u32,
    },
}

/// The daemon's answer to [`ResumeMsg::Resume`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ResumeAnswer {
    /// The container runs again (resumed now, by this request or a concurrent one).
    Resumed {
        /// How long the restore took, ms (0: it was not suspended any more).
        restore_ms: u64,
    },
    /// The daemon could not resume it: the shim says why and asks again later.
    Failed {
        /// Why, naming the process or the driver's code.
        reason: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_word_changes_generation_at_every_change() {
        let w = next_word(0, true);
        assert!(is_suspended(w));
        let w2 = next_word(w, false);
        assert!(!is_suspended(w2));
        assert_ne!(w2, 0);
        assert!(is_suspended(next_word(w2, true)));
        assert!(!is_suspended(next_word(u32::MAX, false)));
    }

    #[test]
    fn messages_are_externally_tagged() {
        let m = ResumeMsg::Resume { proto: 1 };
        assert_eq!(
            serde_json::to_string(&m).expect("serializes"),
            r#"{"Resume":{"proto":1}}"#
        );
        let a: ResumeAnswer =
            serde_json::from_str(r#"{"Resumed":{"restore_ms":5}}"#).expect("parses");
        assert_eq!(a, ResumeAnswer::Resumed { restore_ms: 5 });
    }
}
