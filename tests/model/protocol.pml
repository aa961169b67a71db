/*
 * The gadei push/apply protocol, as a Promela model checked by Spin.
 *
 * What it models (each proctype names the code whose steps it follows; docs/protocol-model.md
 * says what is left out):
 *   Train(l)    learner l's train thread: gadei.learner.Learner.attach/step/_teardown,
 *               gadei.ring.claim/_take/Producer.drain/release/_keep_record,
 *               ThreadPush.push (hand-off).
 *   Push(l)     learner l's push thread: gadei.transport.ThreadPush._run,
 *               gadei.ring.Producer.wait_space/publish, SlotWriter.write_grads.
 *   Server      gadei.server.Server.serve/_serve_each/_drain/_take/_update/_pause,
 *               gadei.ring.Consumer.poll/sleep/release, native gd_poll_rings, the update
 *               kernels' apply-and-clear (native/kernels.c gd_sgd ... clear=1).
 *   Supervisor  watchdog.supervisor.Supervisor.run/_look_at_learners/_supervise/checkpoint/
 *               _stop_job/_restart_server/_ended, watchdog.learners.Learners.look/_track/_died/progress/
 *               resume, left_record,
 *               gadei.checkpoint.capture/take (the checkpoint hold).
 *   Other       a learner the supervisor did not launch (OCLAIMS > 0): gadei.ring.claim/_take/
 *               Producer.release of a process with no number, OCLAIMS claims one after the other.
 *   Crash       SIGKILL of a learner process (both its threads) or of the server, at any step.
 *   Stop        `gadei stop` (gadei.launch.stop_job: run_state SERVING -> STOPPING).
 *
 * Bounds (-D on the spin command line): L learners (1..2, one ring each: capacity == L),
 * S slots per ring, N gradients in each learner's schedule, LCRASH learner kills, SCRASH
 * server kills, CKPTS checkpoints the supervisor tries, STOPS 1 when `gadei stop` may come,
 * OCLAIMS claims by a learner the supervisor did not launch.
 *
 * A gradient is sample k of learner l's schedule, g = l*N + k; a slot's payload is the set
 * (bitmask) of gradients accumulated into it since it was last cleared: backward of the
 * `publish` transport accumulates into the slot, and write_grads of the `thread` transport
 * leaves a parameter without a gradient (or a sparse one) to the zeroed slot, so a slot not
 * cleared on hand-back carries its old gradient into the next one.
 *
 * Faulty variants: -DBUG_HEAD_BEFORE_HEADER (publish stores head before the slot header),
 * -DBUG_NO_ZERO (the server hands a slot back without clearing it). The code as it was
 * before the fixes this model led to: -DOLD_DRAIN (Server._drain), -DOLD_CAPTURE
 * (checkpoint.capture), -DOLD_PID_ORDER (ring._take/Producer.release, learners._died),
 * -DOLD_RESTART_STOP (Supervisor._restart_server/run), -DOLD_KILL_AFTER_RELEASE (no record of a
 * learner's counters after it released its entry; learners._died counts a learner killed
 * after it released its entry by `seen`), -DOLD_LAST_OWNER (a new owner's ring._take copied
 * the previous owner's counters into the entry it claimed, where the next claim overwrote them).
 *
 * Properties: assertions (the slot header read is the one written for that position; no
 * gradient applied twice; 0 <= head - tail <= S wherever head or tail moves; at the end,
 * every ring empty, every published gradient applied once and, with no `gadei stop`, every
 * gradient of every schedule once; a restart never undoes a `gadei stop`), invalid end
 * states (deadlock), non-progress cycles (progress_publish, progress_apply labels), and the
 * LTL claims `ends` and `stop_ends` (-DLIVENESS). tests/model/check.py runs them.
 */

#ifndef L
#define L 1
#endif
#ifndef S
#define S 2
#endif
#ifndef N
#define N 3
#endif
#ifndef LCRASH
#define LCRASH 1
#endif
#ifndef SCRASH
#define SCRASH 1
#endif
#ifndef CKPTS
#define CKPTS 1
#endif
#ifndef STOPS
#define STOPS 1
#endif
#ifndef OCLAIMS
#define OCLAIMS 0
#endif
#define OTHER_PID 200   /* pids of the learner the supervisor did not launch: 200 + its claim (launched: 1, 2, ...) */

#define G (L * N)   /* gradients in all schedules */
#define NONE 255    /* no ring */

/* gadei.layout: run states and learner entry states (tests/test_protocol_model.py checks them) */
#define CREATED 0
#define SERVING 1
#define STOPPING 2
#define STOPPED 3
#define FREE 0
#define CLAIMING 1
#define ACTIVE 2
#define LEAVING 3
#define DEAD 4

/* ------------------------------------------------------------------ the region */
byte run_state = SERVING;
byte head[L];          /* entry.head: slots published, ever (learner writes) */
byte tail[L];          /* entry.tail: slots consumed, ever (server writes) */
byte hdr[L * S];       /* slot header (version, step, samples, kind): the ring position + 1 it was written for */
byte pay[L * S];       /* slot payload: set of gradients accumulated into it */
byte estate[L];        /* entry.state */
byte epid[L];          /* entry.lease: the owner's pid (0: free) */
byte eplain[L];        /* entry.pid: whose counters applied_samples and samples are (kept after release) */
bool eowner_alive[L];  /* owner_alive(): the lease's pid is a running process */
byte esamples[L];      /* entry.samples: gradients the owner handed over (learner writes) */
byte applied_samples[L]; /* entry.applied_samples (server writes; reset by a new owner after its drain) */
byte elast_pid[L];     /* entry.last_pid: the pid of launched learner l's process that left last (entry l) */
byte elast_applied[L]; /* entry.last_applied: what the server applied of it (-DOLD_LAST_OWNER: the copy
                          of the claimed entry's previous owner, kept in that entry) */
bool hold;             /* header.hold: a checkpointer asks the server to pause */
bool held;             /* header.held: the server is paused between two updates */
bit epoch;             /* header.hold_epoch, modulo 2 */

/* the weights: how many times each gradient is in them */
byte cnt[G];
/* gradients published into this region (and, after a restart, those its checkpoint holds) */
bool pubd[G];

/* ------------------------------------------------------------------ checkpoint files */
bool ck_valid;
byte ck_cnt[G];
byte ck_prog[L];       /* progress: samples of each schedule the weights hold (N: done) */

/* ------------------------------------------------------------------ processes */
bool salive = true;    /* the server process runs */
bool sin = true;       /* the Server proctype is inside a serve (not idle) */
bool sgo;              /* the supervisor started a server */
bool lgo[L];           /* the supervisor started learner l */
bool tin[L];           /* learner l's process exists (train thread not yet gone) */
bool pin[L];           /* learner l's push thread runs */
bool pgo[L];           /* the train thread started the push thread */
bool killed[L];        /* learner l's process was SIGKILLed */
byte item[L];          /* ThreadPush._item: gradient g + 1, or 0 */
bool closing[L];       /* _Handoff.closing */
byte perr[L];          /* ThreadPush._error: 0, 1 JobStopped, 2 ServerGone */
byte myring[L];        /* the ring learner l's current process owns (bookkeeping of the kill) */
byte lexit[L];         /* exit of learner l's process: 0 running/killed, 1 status 0, 2 error */
byte pidof[L];         /* pid of learner l's current process (1, 2, ... per launch) */
byte seen[L];          /* Launched.seen: entry.samples when the supervisor last looked */
byte start_at[L];      /* Launched.start_at: where learner l's schedule goes on */
byte first[L];         /* the sample the current process of learner l starts at */
bool lrun[L];          /* Launched.running (the supervisor's view) */
bool done[L];          /* Launched.done */
bool finished;         /* header.finished: the supervisor stopped the job, every launched learner being done */
bool user_stop;        /* `gadei stop` was given */
bool wd_ended;
byte lcrashes, scrashes;
byte other_r = NONE;   /* the entry the learner the supervisor did not launch holds */

#define ROOM(r) (head[r] - tail[r] < S)
/* 0 <= head - tail <= slots: asserted wherever head or tail changes */
#define RING_OK(r) assert(head[r] >= tail[r] && head[r] - tail[r] <= S)

#if L == 1
#define WORK (head[0] != tail[0])
#define BUSY (epid[0] != 0 && eowner_alive[0])
#define LEARNERS_IDLE (!tin[0] && !pin[0])
#define ALL_FINISHED (done[0])
#else
#define WORK (head[0] != tail[0] || head[1] != tail[1])
#define BUSY ((epid[0] != 0 && eowner_alive[0]) || (epid[1] != 0 && eowner_alive[1]))
#define LEARNERS_IDLE (!tin[0] && !pin[0] && !tin[1] && !pin[1])
#define ALL_FINISHED (done[0] && done[1])
#endif

/* ------------------------------------------------------------------ the server's steps */

/* Consumer.poll -> native gd_poll_rings: the next ring, round-robin from nxt, with head != tail */
inline poll() {
    d_step {
        r = NONE; i = 0;
        do
        :: i < L && head[(nxt + i) % L] != tail[(nxt + i) % L] -> r = (nxt + i) % L; break
        :: i < L && head[(nxt + i) % L] == tail[(nxt + i) % L] -> i++
        :: i >= L -> break
        od;
        if
        :: r != NONE -> nxt = (r + 1) % L
        :: else -> skip
        fi;
        i = 0
    }
}

/* Server._take + _update: read the slot header, apply and clear the payload in one pass
 * (the kernels' clear=1), bump the version; then the counters; then Consumer.release
 * stores tail + 1 (the hand-back). */
inline update() {
    d_step {
        s = tail[r] % S;
        /* exactly once, part 1: the server never reads a slot still being written */
        assert(hdr[r * S + s] == tail[r] + 1);
        i = 0;
        do
        :: i < G ->
            if
            :: pay[r * S + s] & (1 << i) ->
                /* exactly once, part 2: no gradient is applied twice */
                assert(cnt[i] == 0);
                cnt[i]++
            :: else -> skip
            fi;
            i++
        :: else -> break
        od;
#ifndef BUG_NO_ZERO
        pay[r * S + s] = 0;
#endif
        i = 0
    }
progress_apply:
    /* entry.applied_samples += samples (one per gradient here), then Consumer.release:
     * store64(tail, tail + 1). One step: nothing reads applied_samples in between (a
     * checkpoint copies it only between two updates, the supervisor after the ring drained) */
    d_step { applied_samples[r]++; tail[r]++; RING_OK(r) }
}

/* Server._pause: stay between two updates until the checkpointer lets go, or its hold_limit
 * passes and the server takes the hold back itself. */
inline pause() {
    held = true;
    if
    :: !hold -> skip
    :: atomic { hold -> hold = false }   /* hold_limit passed */
    fi;
    epoch = 1 - epoch;   /* hold_epoch += 1: one pause at most ends within a copy, so its parity tells */
    held = false
}

/* The server: Server.serve (_serve_each, then _drain), _pause, _take/_update, Consumer.poll/sleep/release */
proctype Server() {
    byte r, s, i, nxt;
end_idle:
    do
    :: atomic { sgo -> sgo = false; nxt = 0 }
        {
            /* Server._serve_each */
            do
            :: run_state == SERVING ->
                if
                :: hold -> pause()
                :: else -> skip
                fi;
                poll();
                if
                :: r != NONE -> update()
                :: else ->  /* Consumer.sleep on the doorbell until work, a hold or a stop */
                    (WORK || hold || run_state != SERVING)
                fi
            :: run_state != SERVING -> break
            od;
            /* Server._drain: apply what is published until no live learner owns a ring */
            do
            :: hold -> pause()
            :: !hold ->
                poll();
                if
                :: r != NONE -> update()
                :: r == NONE && BUSY -> (WORK || hold || !BUSY)
                :: r == NONE && !BUSY ->
#ifndef OLD_DRAIN
                    /* one more look: a learner that died after the first one published
                     * everything it did before it died */
                    poll();
#endif
                    if
                    :: r != NONE -> update()
                    :: else -> break
                    fi
                fi
            od;
            run_state = STOPPED
        } unless { !salive };
        sin = false
    :: wd_ended -> break
    od
}

/* ------------------------------------------------------------------ a learner */

/* ring._take after the drain, before the counters are reset: pid 0 (a reader matching the
 * previous owner by pid must not take the reset counters for its own). -DOLD_LAST_OWNER:
 * _keep_last_owner, the previous owner's (pid, applied_samples) copied into this entry's
 * (last_pid, last_applied), then pid 0 (pid 0: a claimant died after its copy, which is
 * kept). One step: the code's order (last_pid 0 while last_applied changes) is for its
 * reader's two reads, atomic here. */
#if defined(OLD_LAST_OWNER)
#define KEEP_LAST_OWNER(e) \
    d_step { \
        if \
        :: eplain[e] != 0 -> elast_applied[e] = applied_samples[e]; elast_pid[e] = eplain[e]; eplain[e] = 0 \
        :: else -> skip \
        fi \
    }
#elif defined(OLD_KILL_AFTER_RELEASE)
#define KEEP_LAST_OWNER(e) skip
#else
#define KEEP_LAST_OWNER(e) eplain[e] = 0
#endif

/* gadei.ring.claim: a free entry first, else one whose owner died (lease CAS) */
inline claim() {
    d_step {
        r = NONE; i = 0;
        do
        :: i < L && epid[i] == 0 -> r = i; break
        :: i < L && epid[i] != 0 -> i++
        :: i >= L -> break
        od;
        i = 0;
        do
        :: r == NONE && i < L && epid[i] != 0 && !eowner_alive[i] -> r = i; break
        :: r == NONE && i < L && !(epid[i] != 0 && !eowner_alive[i]) -> i++
        :: else -> break
        od;
        if
        :: r != NONE ->
            epid[r] = pidof[l]; eowner_alive[r] = true; estate[r] = CLAIMING; myring[l] = r;
#ifdef OLD_PID_ORDER
            eplain[r] = pidof[l];
#endif
            skip
        :: else -> skip
        fi;
        i = 0
    }
}

/* Producer.release -> _keep_record: a launched learner whose ring is drained keeps what the
 * server applied of it in the entry of its number, which no claim writes */
inline keep_record() {
#if !defined(OLD_LAST_OWNER) && !defined(OLD_KILL_AFTER_RELEASE)
    d_step {
        if
        :: tail[r] == head[r] -> elast_applied[l] = applied_samples[r]; elast_pid[l] = pidof[l]
        :: else -> skip   /* left undrained (the job stopped, the server gone): its entry's pid names it */
        fi
    }
#else
    skip
#endif
}

/* Producer.release: the entry is free for the next learner */
inline release() {
    d_step {
        estate[r] = FREE; epid[r] = 0; eowner_alive[r] = false; myring[l] = NONE;
#ifdef OLD_PID_ORDER
        eplain[r] = 0;
#endif
        skip
    }
}

/* Learner l's train thread: Learner.attach, ring.claim/_take, Learner.step + ThreadPush.push, Learner._teardown */
proctype Train(byte l) {
    byte r, i, k;
end_idle:
    do
    :: atomic { lgo[l] -> lgo[l] = false; k = first[l] }
        {
            /* Learner.attach */
#if OCLAIMS > 0
            /* every entry taken (capacity == L) while the other learner holds one: CapacityError, and
             * the supervisor starts it again after a back-off, which changes nothing in the region:
             * here it waits */
            (other_r == NONE || run_state != SERVING);
#endif
            if
            :: run_state != SERVING -> lexit[l] = 1; goto gone   /* JobStopped */
            :: else -> skip
            fi;
            claim();
            if
            :: r == NONE -> lexit[l] = 2; goto gone   /* CapacityError */
            :: else -> skip
            fi;
            /* ring._take: apply what a previous owner published, then clear the slots */
            if
            :: tail[r] == head[r] -> skip
            :: tail[r] != head[r] && !salive -> release(); lexit[l] = 2; goto gone   /* GadeiTimeout */
            fi;
            /* zero the slots */
            d_step { i = 0; do :: i < S -> pay[r * S + i] = 0; i++ :: else -> break od; i = 0 }
            KEEP_LAST_OWNER(r)
            d_step { applied_samples[r] = 0; esamples[r] = 0 }   /* then the counters the server writes */
#ifndef OLD_PID_ORDER
            eplain[r] = pidof[l];   /* entry.pid: only once the counters are this process's */
#endif
            d_step { estate[r] = ACTIVE; pgo[l] = true; pin[l] = true }   /* ThreadPush starts its push thread */
            /* Learner.step, ThreadPush.push: hand each gradient to the push thread */
            do
            :: k < N && run_state == SERVING ->
                (item[l] == 0 || perr[l] != 0);   /* the previous one is written */
                if
                :: perr[l] != 0 -> break
                :: else -> item[l] = l * N + k + 1; k++
                fi;
#ifdef OLD_KILL_AFTER_RELEASE
                esamples[r]++   /* Learner.step: entry.add("samples") after the push (read only by _track) */
#else
                skip
#endif
            :: k < N && run_state != SERVING -> break   /* JobStopped */
            :: k >= N -> break
            od;
            /* Learner._teardown: the push thread publishes what it holds and ends; drain; release */
            closing[l] = true;
            !pin[l];
            estate[r] = LEAVING;
            if
            :: tail[r] == head[r]
            :: run_state == STOPPED
            :: !salive
            fi;
            keep_record();
            release();
            lexit[l] = (perr[l] == 2 -> 2 : 1);
gone:
            skip
        } unless { killed[l] };
        tin[l] = false
    :: wd_ended -> break
    od
}

/* Learner l's push thread: ThreadPush._run, Producer.wait_space, SlotWriter.write_grads, Producer.publish */
proctype Push(byte l) {
    byte r, s, g;
end_idle:
    do
    :: atomic { pgo[l] -> pgo[l] = false; r = myring[l] }
        {
            do
            :: item[l] != 0 ->
                g = item[l] - 1;
                /* Producer.wait_space: each wait slice asks on_slice, which raises when the
                 * job stops or the server is gone */
                if
                :: ROOM(r) -> skip
                :: run_state != SERVING -> d_step { perr[l] = 1; item[l] = 0 }; break
                :: !salive -> d_step { perr[l] = 2; item[l] = 0 }; break
                fi;
                /* SlotWriter.write_grads, then Producer.publish: the slot header, then
                 * store64(head), which publishes both (one step for payload and header:
                 * nothing reads them before head moves) */
#ifndef BUG_HEAD_BEFORE_HEADER
                d_step {
                    s = head[r] % S;
                    pay[r * S + s] = pay[r * S + s] | (1 << g);
                    hdr[r * S + s] = head[r] + 1
                }
progress_publish:
                d_step { head[r]++; pubd[g] = true; RING_OK(r) }
#else
                d_step { s = head[r] % S; pay[r * S + s] = pay[r * S + s] | (1 << g) }
                d_step { head[r]++; pubd[g] = true; RING_OK(r) };   /* head before the header */
progress_publish:
                hdr[r * S + s] = head[r];
#endif
                item[l] = 0
            :: item[l] == 0 && closing[l] -> break
            od
        } unless { killed[l] };
        pin[l] = false
    :: wd_ended -> break
    od
}

/* ------------------------------------------------------------------ the supervisor */

inline launch(n) {
  d_step {
    pidof[n] = (pidof[n] == 0 -> n + 1 : pidof[n] + L); pgo[n] = false; seen[n] = 0; myring[n] = NONE; lrun[n] = true; lexit[n] = 0; killed[n] = false; perr[n] = 0; item[n] = 0;
    closing[n] = false; first[n] = start_at[n]; tin[n] = true; lgo[n] = true
  }
}

/* Learners.progress: a running learner's record (it left its entry) or applied_samples (its
 * entry found by pid) on top of where it started; a dead one's start_at already counts what
 * it published */
#if L == 1
#define RECORDED(n) (elast_pid[0] == pidof[n])
#else
#define RECORDED(n) (elast_pid[0] == pidof[n] || elast_pid[1] == pidof[n])
#endif
inline progress_of(n) {
    if
    :: done[n] -> ck_tmp_prog[n] = N
    /* it left its entry: the record it kept (ring.applied_in reads it first) */
    :: !done[n] && lrun[n] && elast_pid[0] == pidof[n] -> ck_tmp_prog[n] = start_at[n] + elast_applied[0]
#if L > 1
    :: !done[n] && lrun[n] && elast_pid[0] != pidof[n] && elast_pid[1] == pidof[n] -> ck_tmp_prog[n] = start_at[n] + elast_applied[1]
#endif
    :: !done[n] && lrun[n] && !RECORDED(n) && eplain[0] == pidof[n] -> ck_tmp_prog[n] = start_at[n] + applied_samples[0]
#if L > 1
    :: !done[n] && lrun[n] && !RECORDED(n) && eplain[1] == pidof[n] -> ck_tmp_prog[n] = start_at[n] + applied_samples[1]
#endif
    :: else -> ck_tmp_prog[n] = start_at[n]
    fi
}

/* checkpoint.capture -> _copy: the weights, then the counters */
inline copy() {
    d_step { i = 0; do :: i < G -> ck_tmp[i] = cnt[i]; i++ :: else -> break od; i = 0 }
    d_step {
        progress_of(0);
#if L > 1
        progress_of(1);
#endif
    }
}

/* checkpoint.save: written under a temporary name and renamed (atomic) */
inline commit() {
    d_step {
        i = 0; do :: i < G -> ck_cnt[i] = ck_tmp[i]; i++ :: else -> break od; i = 0;
        do :: i < L -> ck_prog[i] = ck_tmp_prog[i]; i++ :: else -> break od; i = 0;
        ck_valid = true
    }
}

/* Supervisor.checkpoint -> checkpoint.take -> capture */
inline checkpoint() {
    ckpts++;
    if
    :: run_state != SERVING && run_state != STOPPING ->
        copy(); commit()   /* the server stopped: nothing changes the region */
    :: (run_state == SERVING || run_state == STOPPING) && !salive ->
#ifndef OLD_CAPTURE
        skip               /* the server died, maybe within an update: no copy */
#else
        copy(); commit()
#endif
    :: (run_state == SERVING || run_state == STOPPING) && salive ->
        if
        :: atomic { !hold -> hold = true }   /* the code first waits for the last pause to end
                                                 (held false); taking the hold without waiting, as
                                                 here, covers that and more */
            if
            :: held ->
                e = epoch;
                copy();
                if
                :: held && epoch == e -> commit()
                :: else -> skip   /* the server went on before the copy was done */
                fi
            :: !salive -> skip     /* the server did not pause: it died */
            :: !hold || run_state == STOPPED -> skip   /* it took the hold back, or stopped: the wait times out */
            fi;
            d_step {
                if :: hold -> hold = false :: else -> skip fi;
                e = 0; i = 0; do :: i < G -> ck_tmp[i] = 0; i++ :: else -> break od; i = 0;
                do :: i < L -> ck_tmp_prog[i] = 0; i++ :: else -> break od; i = 0
            }
        :: hold -> skip   /* another checkpoint is being taken */
        fi
    fi
}

/* Supervisor._restart_server: kill the launched learners, recreate the region from the newest
 * checkpoint (--replace --resume), start the server and the learners again */
inline restart_server() {
    atomic {
        i = 0;
        do
        :: i < L -> if :: tin[i] -> killed[i] = true; if :: myring[i] != NONE -> eowner_alive[myring[i]] = false :: else fi :: else fi; i++
        :: else -> break
        od;
        i = 0
    }
    (LEARNERS_IDLE && !sin && other_r == NONE);   /* the other learner, if any, gives its entry back */
    d_step {
        /* a `gadei stop` that the dead server had not finished is carried to the new region */
#ifndef OLD_RESTART_STOP
        carried = (run_state == STOPPING && !own_stop);
#endif
        own_stop = false;
        i = 0;
        do
        :: i < L ->
            head[i] = 0; tail[i] = 0; estate[i] = FREE; epid[i] = 0; eplain[i] = 0; eowner_alive[i] = false;
            elast_pid[i] = 0; elast_applied[i] = 0;
            applied_samples[i] = 0; esamples[i] = 0; seen[i] = 0; myring[i] = NONE; lrun[i] = false; killed[i] = false;
            start_at[i] = (ck_valid -> ck_prog[i] : 0); done[i] = (start_at[i] >= N);
            i++
        :: else -> break
        od;
        i = 0;
        do :: i < L * S -> hdr[i] = 0; pay[i] = 0; i++ :: else -> break od;
        i = 0;
        do :: i < G -> cnt[i] = (ck_valid -> ck_cnt[i] : 0); pubd[i] = (cnt[i] > 0); i++ :: else -> break od;
        i = 0;
        hold = false; held = false; epoch = 0; run_state = SERVING; finished = false;
        salive = true; sin = true; sgo = true
    }
#ifndef OLD_RESTART_STOP
    stopping = false;   /* the learners go on, and the supervisor stops the job when they are done */
#endif
    if
    :: carried ->
        atomic { if :: run_state == SERVING -> run_state = STOPPING :: else -> skip fi };
        /* a `gadei stop` is never undone by a restart */
        assert(!user_stop || run_state != SERVING)
    :: else ->
        assert(!user_stop || run_state != SERVING);
        i = 0;
        do
        :: i < L -> if :: !done[i] -> launch(i) :: else -> skip fi; i++
        :: else -> break
        od;
        i = 0
    fi
}

/* ring.left_record, one entry: its own applied_samples while pid names it (its ring drained) */
#define LEFT_FROM(n, j) \
    :: eplain[j] == pidof[n] -> start_at[n] = start_at[n] + applied_samples[j]
#if L == 1
#define LEFT_IN(n) (eplain[0] == pidof[n])
#define LEFT_DRAINED(n) (tail[0] == head[0])
#else
#define LEFT_IN(n) (eplain[0] == pidof[n] || eplain[1] == pidof[n])
#define LEFT_DRAINED(n) ((eplain[0] != pidof[n] || tail[0] == head[0]) && (eplain[1] != pidof[n] || tail[1] == head[1]))
#endif

/* Learners._died: mark the entry dead, wait until the server applied what it published,
 * and go on after what the weights hold of it; then start it again */
inline died(n) {
    lrun[n] = false;
    r = NONE;
    d_step {
        if
        :: epid[0] == pidof[n] -> r = 0
#if L > 1
        :: epid[1] == pidof[n] -> r = 1
#endif
        :: else -> skip
        fi
    }
    if
    :: r != NONE ->
        atomic { if :: estate[r] == ACTIVE -> estate[r] = DEAD :: else -> skip fi }
        if
        :: tail[r] == head[r] ->   /* its counters, unless it died before they were */
#ifndef OLD_PID_ORDER
            start_at[n] = start_at[n] + (eplain[r] == pidof[n] -> applied_samples[r] : 0)
#else
            start_at[n] = start_at[n] + applied_samples[r]
#endif
        :: !salive -> skip   /* the server's restart resumes every learner from a checkpoint */
        fi
    :: else ->
#ifndef OLD_KILL_AFTER_RELEASE
        /* ring.left_record: it left its entry (or was never seen holding it). The record it
         * kept (last_pid, last_applied) if any; else, while an entry's pid is its own, wait until
         * the ring is drained (or the server is gone), then its applied_samples; else what the
         * supervisor saw. One step: the code reads each answer between two reads of the field
         * naming it. */
        atomic {
            if
            :: elast_pid[0] == pidof[n] -> start_at[n] = start_at[n] + elast_applied[0]
#if L > 1
            :: elast_pid[0] != pidof[n] && elast_pid[1] == pidof[n] -> start_at[n] = start_at[n] + elast_applied[1]
#endif
            :: !RECORDED(n) ->
                (!LEFT_IN(n) || LEFT_DRAINED(n) || !salive);
                if
                :: LEFT_IN(n) && !LEFT_DRAINED(n) -> skip   /* the server is gone: its restart resumes every learner */
                LEFT_FROM(n, 0)
#if L > 1
                LEFT_FROM(n, 1)
#endif
                :: else -> start_at[n] = start_at[n] + seen[n]   /* 0 here: see TRACK */
                fi
            fi
        }
#else
        start_at[n] = start_at[n] + seen[n]   /* it left its entry: what the supervisor saw */
#endif
    fi;
    seen[n] = 0
}

/* Learners._track: the samples counter of learner n's entry (ring r), as the supervisor last saw it.
 * Only the old variant has it (and entry.samples): with left_record, `seen` is read only by a
 * learner whose entry names it nowhere, and leaving it 0 there can only add counter-examples
 * (seen <= what the server applied of a learner that drained), so the checks stay sound and
 * smaller. */
#define TRACK(n, r) \
    :: lrun[n] && epid[r] == pidof[n] && seen[n] != esamples[r] -> seen[n] = esamples[r]

#define WD_LEARNER(n) \
    :: lrun[n] && !tin[n] && !pin[n] && killed[n] -> died(n) \
    :: lrun[n] && !tin[n] && !pin[n] && !killed[n] && lexit[n] == 1 -> lrun[n] = false; done[n] = true \
    :: lrun[n] && !tin[n] && !pin[n] && !killed[n] && lexit[n] == 2 -> died(n) \
    :: !lrun[n] && !done[n] && salive && run_state == SERVING -> launch(n)

/* The supervisor: Supervisor.run and what it calls (checkpoints, learner deaths, server restarts, _ended) */
active proctype Supervisor() {
    byte i, r, e, ckpts;
    byte ck_tmp[G];
    byte ck_tmp_prog[L];
    bool stopping, own_stop, carried;
    atomic {
        sgo = true;
        i = 0; do :: i < L -> launch(i); i++ :: else -> break od; i = 0
    }
    do
    :: run_state == STOPPED -> break
    :: !salive && !sin && run_state != STOPPED -> restart_server()
    WD_LEARNER(0)
#if L > 1
    WD_LEARNER(1)
#endif
#ifdef OLD_KILL_AFTER_RELEASE
    TRACK(0, 0)
#if L > 1
    TRACK(0, 1)
    TRACK(1, 0)
    TRACK(1, 1)
#endif
#endif
    :: !stopping && ALL_FINISHED && run_state == SERVING && salive ->   /* Supervisor._stop_job */
        stopping = true;
        atomic { finished = true; if :: run_state == SERVING -> run_state = STOPPING; own_stop = true :: else -> skip fi }
    :: ckpts < CKPTS && salive && run_state == SERVING -> checkpoint()
    od;
    /* Supervisor._ended: reap the learners; the server exits */
    (LEARNERS_IDLE && !sin);
    /* exactly once, part 3: every gradient published into this region is applied; with no
     * `gadei stop`, every gradient of every schedule is in the weights */
    d_step {
        i = 0;
        do
        :: i < L -> assert(head[i] == tail[i]); i++
        :: else -> break
        od;
        i = 0;
        do
        :: i < G -> assert(!pubd[i] || cnt[i] == 1); assert(user_stop || cnt[i] == 1); i++
        :: else -> break
        od;
        i = 0
    }
    wd_ended = true
}

#ifdef LIVENESS
/* every run ends: the server stops and every learner and the supervisor end (a deadlock
 * or a cycle that never gets there is a counter-example) */
ltl ends { <> wd_ended }
/* a `gadei stop` ends every process */
ltl stop_ends { [] (user_stop -> <> wd_ended) }
#endif

/* ------------------------------------------------------------------ faults and `gadei stop` */

#define KILL_LEARNER(n) \
    :: atomic { lcrashes < LCRASH && tin[n] && !killed[n] && !wd_ended -> \
        killed[n] = true; lcrashes++; \
        if :: myring[n] != NONE -> eowner_alive[myring[n]] = false :: else -> skip fi }

#if OCLAIMS > 0
#define OTHER_CLAIM(e) \
    :: atomic { epid[e] == 0 && head[e] == tail[e] && run_state == SERVING && salive -> \
        r = e; epid[r] = OTHER_PID + k; eowner_alive[r] = true; estate[r] = CLAIMING; other_r = r }

/* A learner the supervisor did not launch (`gadei learn` without --entry, a bridge node): it
 * claims a free entry whose ring is drained (one with a dead owner it leaves alone), resets the
 * counters as ring._take does, and gives the entry back with no record (it has no number), OCLAIMS
 * times one after the other; its gradients are left out (it publishes none). It claims only while
 * the server runs, and a server restart waits until it gave its entry back (the restart recreates
 * the region; in the code it would find its region gone). */
active proctype Other() {
    byte r, k;
end:
    do
    :: k < OCLAIMS ->
        if
        OTHER_CLAIM(0)
#if L > 1
        OTHER_CLAIM(1)
#endif
        :: wd_ended -> break
        fi;
        KEEP_LAST_OWNER(r);
        d_step { applied_samples[r] = 0; esamples[r] = 0 }
        eplain[r] = OTHER_PID + k;
        d_step { estate[r] = FREE; epid[r] = 0; eowner_alive[r] = false; other_r = NONE; r = 0; k++ }
    :: k >= OCLAIMS -> break
    od
}
#endif

/* SIGKILL of a learner process or of the server, at any step */
active proctype Crash() {
end:
    do
    KILL_LEARNER(0)
#if L > 1
    KILL_LEARNER(1)
#endif
    :: atomic { scrashes < SCRASH && salive && sin && !wd_ended -> salive = false; scrashes++ }
    od
}

/* `gadei stop`: gadei.launch.stop_job */
active proctype Stop() {
end:
    if
    :: atomic { STOPS && run_state == SERVING && !wd_ended -> run_state = STOPPING; user_stop = true }
    :: true -> skip
    fi
}

init {
    byte n;
    atomic {
        run Server();
        n = 0;
        do
        :: n < L -> run Train(n); run Push(n); n++
        :: else -> break
        od
    }
}
