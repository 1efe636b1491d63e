-- interactiond's SQLite schema. Applied at every start (idempotent); PRAGMA user_version tells
-- which migrations a file has had. Times are integer milliseconds since the epoch (UTC); JSON
-- columns hold compact JSON text. Every state change is one transaction that updates its rows
-- and appends its events together.

CREATE TABLE IF NOT EXISTS playbooks (
    id            TEXT PRIMARY KEY,                  -- ORG/NAME
    open_requests INTEGER NOT NULL DEFAULT 0,        -- kept in step with requests.open
    created_at    INTEGER NOT NULL
);

-- One row per version; `active` is cleared on every version of a name when it is deleted.
CREATE TABLE IF NOT EXISTS definitions (
    playbook   TEXT NOT NULL REFERENCES playbooks(id),
    type       TEXT NOT NULL CHECK (type IN ('interaction', 'workflow')),
    name       TEXT NOT NULL,
    version    INTEGER NOT NULL,
    source     TEXT NOT NULL,
    source_sha TEXT NOT NULL,
    overview   TEXT NOT NULL,
    description TEXT,
    uses       TEXT NOT NULL DEFAULT '[]',           -- JSON: [[type, name], ...] a workflow calls
    answer_schema TEXT,                              -- JSON: the answer schema its requests share
    active     INTEGER NOT NULL DEFAULT 1,
    created_at INTEGER NOT NULL,
    created_by TEXT NOT NULL,
    PRIMARY KEY (playbook, type, name, version)
);

CREATE TABLE IF NOT EXISTS runs (
    seq          INTEGER PRIMARY KEY,                -- listing order and cursors
    playbook     TEXT NOT NULL REFERENCES playbooks(id),
    run_id       TEXT NOT NULL,
    type         TEXT NOT NULL,
    name         TEXT NOT NULL,
    version      INTEGER NOT NULL,
    input        TEXT NOT NULL,
    input_sha    TEXT NOT NULL,
    status       TEXT NOT NULL CHECK (status IN (
                     'started',                      -- accepted, nothing open yet
                     'waiting',                      -- started -> waiting: a request is open
                     'succeeded',                    -- -> answered, delivered, or the tool answered
                     'invalid_input', 'conflict', 'unavailable',
                     'rejected',                     -- -> expired, undelivered, cancelled
                     'failed')),
    kind         TEXT,
    output       TEXT,
    problem      TEXT,
    tools_called INTEGER NOT NULL DEFAULT 0,         -- a tool call was sent under this run id
    events       INTEGER NOT NULL DEFAULT 0,         -- per-run event counter (gap-free run_seq)
    parent       TEXT,                               -- the workflow run that started it
    state        TEXT,                               -- a workflow's position and data
    created_at   INTEGER NOT NULL,
    ended_at     INTEGER,
    created_by   TEXT NOT NULL,
    settled_by   TEXT,
    UNIQUE (playbook, run_id)
);
CREATE INDEX IF NOT EXISTS runs_by_status ON runs (playbook, status, seq);

-- The open question of a run that asks a person; one per run.
CREATE TABLE IF NOT EXISTS requests (
    seq            INTEGER PRIMARY KEY,              -- newest first in the inbox
    id             TEXT NOT NULL UNIQUE,             -- int_<ULID>, the typed API's id
    playbook       TEXT NOT NULL,
    run_id         TEXT NOT NULL,
    type           TEXT NOT NULL,
    name           TEXT NOT NULL,
    version        INTEGER NOT NULL,
    party          TEXT NOT NULL,                    -- rendered `to`
    answerer       TEXT NOT NULL,                    -- rendered `from`, else `to`
    message        TEXT NOT NULL,
    own_schema     TEXT,                             -- its answer schema where its definition's is not it;
                                                     -- NULL: the definition's (NULL too: a notification)
    server         TEXT,                             -- deliver.server, NULL for the inbox
    tool           TEXT,
    status         TEXT NOT NULL CHECK (status IN (
                       'open',                       -- waiting for an answer or a delivery
                       'answered',                   -- open -> answered
                       'notified',                   -- open -> notified (a notification delivered)
                       'expired',                    -- open -> expired
                       'undelivered',                -- open -> undelivered (a notification)
                       'cancelled')),                -- open -> cancelled
    open           INTEGER NOT NULL DEFAULT 1,       -- 1 while status = 'open'
    delivery_state TEXT NOT NULL CHECK (delivery_state IN (
                       'in_inbox', 'to_deliver', 'delivering', 'delivered', 'retrying',
                       'undelivered', 'cancelling')),
    attempts       INTEGER NOT NULL DEFAULT 0,
    asked_at       INTEGER NOT NULL,
    expires_at     INTEGER NOT NULL,
    answer         TEXT,
    answer_id      INTEGER,
    answered_by    TEXT,
    answered_at    INTEGER,
    claimed_for    TEXT,
    reply_id       TEXT,
    sent_conversation TEXT,
    sent_id        TEXT,
    conversation   TEXT,                             -- the reading key, when replies are read
    refused_replies INTEGER NOT NULL DEFAULT 0,
    told           INTEGER NOT NULL DEFAULT 0,
    deliver_args   TEXT,                             -- rendered once at the run's start
    attempt_started_at INTEGER,                      -- of the attempt in flight or the last one
    reading        INTEGER REFERENCES readings(id),  -- the reading it joined, once delivered
    approval       TEXT,                             -- a call's approval gate (JSON); NULL for a question
    follow_up      TEXT,                             -- JSON: its reminders, escalation, default answer
    reminded       INTEGER NOT NULL DEFAULT 0,       -- reminders so far (request_reminded's n)
    escalated_to   TEXT,                             -- once escalated: the party asked too, who may answer
    reply_sender   TEXT,                             -- who wrote the reply that answered
    answered_by_name TEXT,                           -- who answered, in words: a token's or person's name, a sender
    digest         TEXT,                             -- sha256 of what it shows (request_digest); NULL: opened before
    on_behalf_of   TEXT,                             -- a deputy's answer: the person they stood for
    UNIQUE (playbook, run_id)
);
CREATE INDEX IF NOT EXISTS requests_open ON requests (playbook, seq) WHERE open = 1;
CREATE INDEX IF NOT EXISTS requests_open_party ON requests (playbook, party, seq) WHERE open = 1;
CREATE INDEX IF NOT EXISTS requests_open_escalated ON requests (playbook, escalated_to, seq)
    WHERE open = 1 AND escalated_to IS NOT NULL;
CREATE INDEX IF NOT EXISTS requests_by_status ON requests (status, seq);

-- One reading per (playbook, server, reading tool, conversation key), shared by every open
-- request with that key: one read serves them all.
CREATE TABLE IF NOT EXISTS readings (
    id           INTEGER PRIMARY KEY,
    playbook     TEXT NOT NULL,
    server       TEXT NOT NULL,
    tool         TEXT NOT NULL,
    conversation TEXT NOT NULL,
    since        TEXT NOT NULL DEFAULT '',           -- the newest message id a read listed
    reads        INTEGER NOT NULL DEFAULT 0,         -- reads since a request last joined
    wait_ms      INTEGER NOT NULL DEFAULT 5000,
    UNIQUE (playbook, server, tool, conversation)
);

-- Every message id a reading has dealt with (taken, refused or passed over): never twice.
CREATE TABLE IF NOT EXISTS replies_seen (
    reading  INTEGER NOT NULL REFERENCES readings(id),
    reply_id TEXT NOT NULL,
    PRIMARY KEY (reading, reply_id)
) WITHOUT ROWID;

-- Reminders and escalation messages sent into a delivered request's thread (with replies.tell),
-- each attempted as a delivery is: recorded before it is sent, then 1, 2, 4 and 8 minutes apart.
CREATE TABLE IF NOT EXISTS nudges (
    id         INTEGER PRIMARY KEY,
    playbook   TEXT NOT NULL,
    run_id     TEXT NOT NULL,
    what       TEXT NOT NULL CHECK (what IN ('reminder', 'escalation')),
    n          INTEGER NOT NULL,                     -- the reminder's number (1 for the escalation)
    message    TEXT NOT NULL,
    state      TEXT NOT NULL CHECK (state IN (      -- as a delivery's
                   'to_deliver', 'delivering', 'delivered', 'retrying', 'undelivered')),
    attempts   INTEGER NOT NULL DEFAULT 0,
    started_at INTEGER                               -- of the attempt in flight or the last one
);

-- Events POSTed to the playbooks' webhooks (Standard Webhooks), each queued in its event's own
-- transaction, once a hook; attempted at once, then 1 min, 5 min, 30 min, 2 h and 8 h apart.
CREATE TABLE IF NOT EXISTS webhook_deliveries (
    id         INTEGER PRIMARY KEY,
    playbook   TEXT NOT NULL,
    url        TEXT NOT NULL,                        -- the hook's, when the event was queued
    event_id   INTEGER NOT NULL,                     -- events.id
    type       TEXT NOT NULL,                        -- request_opened, ..., run_ended
    run_id     TEXT,
    body       TEXT NOT NULL,                        -- the bytes signed and sent, every attempt
    state      TEXT NOT NULL CHECK (state IN ('pending', 'sending', 'retrying', 'delivered', 'failed')),
    attempts   INTEGER NOT NULL DEFAULT 0,
    created_at INTEGER NOT NULL,
    started_at INTEGER,                              -- of the attempt in flight or the last one
    next_at    INTEGER,                              -- of the next attempt, while one is to come
    ended_at   INTEGER,                              -- delivered, or the last attempt failed
    history    TEXT NOT NULL DEFAULT '[]'            -- the attempts: [{n, at, status, error}, ...]
);
CREATE INDEX IF NOT EXISTS webhook_deliveries_by_playbook ON webhook_deliveries (playbook, id);

-- Append-only. `id` is monotonic and never reused; run events also carry a gap-free run_seq.
CREATE TABLE IF NOT EXISTS events (
    id       INTEGER PRIMARY KEY AUTOINCREMENT,
    playbook TEXT NOT NULL,
    run_id   TEXT,                                   -- NULL for the playbook's own events
    run_seq  INTEGER,
    type     TEXT NOT NULL,
    at       INTEGER NOT NULL,
    by       TEXT,
    payload  TEXT NOT NULL,
    size     INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS events_by_run ON events (playbook, run_id, id);
CREATE INDEX IF NOT EXISTS events_by_playbook ON events (playbook, id) WHERE run_id IS NULL;

-- Due times for the one timer task: expiries, attempts, lost-attempt checks, reads, waits.
CREATE TABLE IF NOT EXISTS timers (
    key    TEXT PRIMARY KEY,                         -- kind:playbook:ref
    due_at INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS timers_due ON timers (due_at);   -- the timer wheel reads a window at a time

-- API tokens, stored as sha256 hashes of their secrets; also one-time login links and the inbox
-- sessions they trade for (12 h idle, 7 days at most). A person's token, link or session names
-- the person (a party as `to` renders it): it sees and answers only the requests addressed to them.
CREATE TABLE IF NOT EXISTS tokens (
    id         TEXT PRIMARY KEY,                     -- tok_...
    hash       TEXT NOT NULL UNIQUE,
    playbook   TEXT,                                 -- NULL: every playbook
    role       TEXT NOT NULL CHECK (role IN ('reader', 'writer', 'operator')),
    name       TEXT,
    purpose    TEXT NOT NULL DEFAULT 'api' CHECK (purpose IN ('api', 'login', 'session')),
    created_at INTEGER NOT NULL,
    revoked_at INTEGER,
    used_at    INTEGER,                              -- a session's last use (to the minute)
    expires_at INTEGER,                              -- a session's or a login link's end at the latest
    person     TEXT                                  -- NULL: not a person's (an operator's, a program's)
);

-- The daemon's own keys, made once and kept: `answer_links` signs the answer links (HMAC-SHA256).
CREATE TABLE IF NOT EXISTS daemon_keys (
    name       TEXT PRIMARY KEY,
    secret     TEXT NOT NULL,                        -- hex
    created_at INTEGER NOT NULL
);

-- Typed-API idempotency keys: a replay returns the first response.
CREATE TABLE IF NOT EXISTS idempotency (
    caller     TEXT NOT NULL,
    key        TEXT NOT NULL,
    body_sha   TEXT NOT NULL,
    status     INTEGER NOT NULL,
    response   TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (caller, key)
);
CREATE INDEX IF NOT EXISTS idempotency_by_age ON idempotency (created_at);

-- Remembered decisions of a tool call's approval: while one lasts (at most P30D) a matching call
-- addressed to the same party in the playbook is decided without asking. `match` is what the
-- scope compares: the arguments' sha256 (exact), '' (tool), a command's first word or a folder
-- (prefix).
CREATE TABLE IF NOT EXISTS approval_rules (
    id         TEXT PRIMARY KEY,                     -- rul_<ULID>
    playbook   TEXT NOT NULL,
    party      TEXT NOT NULL,                        -- the addressee who answered
    tool       TEXT NOT NULL,
    scope      TEXT NOT NULL CHECK (scope IN ('exact', 'tool', 'prefix')),
    match      TEXT NOT NULL,
    approved   INTEGER NOT NULL,                     -- 1: allowed, 0: denied
    note       TEXT,
    run_id     TEXT NOT NULL,                        -- the run whose answer made it
    made_by    TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    revoked_at INTEGER
);
CREATE INDEX IF NOT EXISTS approval_rules_live ON approval_rules (playbook, party, tool) WHERE revoked_at IS NULL;

-- Deputies: while [starts_at, ends_at) holds on the daemon's clock, what is addressed to `for_person`
-- in the playbook is addressed to `to_person` too; their answer records them and whom they stood for.
CREATE TABLE IF NOT EXISTS deputies (
    id          TEXT PRIMARY KEY,                    -- dep_<ULID>
    playbook    TEXT NOT NULL,
    for_person  TEXT NOT NULL,
    to_person   TEXT NOT NULL,
    starts_at   INTEGER,                             -- NULL: from its making
    ends_at     INTEGER,                             -- NULL: until removed
    created_at  INTEGER NOT NULL,
    created_by  TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS deputies_to ON deputies (playbook, to_person);

-- A quorum approval's addressees besides its party: listing by `to` finds it under each of them.
CREATE TABLE IF NOT EXISTS addressees (
    playbook TEXT NOT NULL,
    person   TEXT NOT NULL,
    run_id   TEXT NOT NULL,
    PRIMARY KEY (playbook, person, run_id)
);
