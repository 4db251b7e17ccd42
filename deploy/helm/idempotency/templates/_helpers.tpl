{{/*
Names and labels shared by every template.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "idempotency.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The resource name prefix: fullnameOverride, else "<release>-<chart>" (just
the release name when it already contains the chart name). At most 52
characters, so suffixes such as "-migrate" and a CronJob's Job suffix fit in 63.
*/}}
{{- define "idempotency.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "<chart>-<version>" for the helm.sh/chart label. */}}
{{- define "idempotency.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels that select the release's pods (never change them: selectors are immutable). */}}
{{- define "idempotency.selectorLabels" -}}
app.kubernetes.io/name: {{ include "idempotency.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels of every resource. */}}
{{- define "idempotency.labels" -}}
helm.sh/chart: {{ include "idempotency.chart" . }}
{{ include "idempotency.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: idempotency
{{- end }}

{{/* Selector labels of the serving pods (the Deployment's). */}}
{{- define "idempotency.serverSelectorLabels" -}}
{{ include "idempotency.selectorLabels" . }}
app.kubernetes.io/component: server
{{- end }}

{{/* The ServiceAccount of the serving pods. */}}
{{- define "idempotency.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "idempotency.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The image reference: repository@digest, else repository:tag (tag defaults to appVersion). */}}
{{- define "idempotency.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* Name of the Secret the chart creates from database.url. */}}
{{- define "idempotency.databaseSecretName" -}}
{{- printf "%s-database" (include "idempotency.fullname" .) }}
{{- end }}

{{/* Name of the hook Secret that gives the migration Job the URL (database.url only). */}}
{{- define "idempotency.migrationSecretName" -}}
{{- printf "%s-migrate-database" (include "idempotency.fullname" .) }}
{{- end }}

{{/*
Where every idempotencyd container finds its files: each volume is mounted as
a directory (never with subPath, so the kubelet's atomic swap of a renewed
Secret or an edited ConfigMap reaches the running pod) and maps the key it
needs to a fixed file name.
*/}}
{{- define "idempotency.paths" -}}
database: /etc/idempotency/database
databaseFile: /etc/idempotency/database/url
tls: /etc/idempotency/tls
tlsCert: /etc/idempotency/tls/tls.crt
tlsKey: /etc/idempotency/tls/tls.key
clientCa: /etc/idempotency/client-ca
clientCaFile: /etc/idempotency/client-ca/ca.crt
policy: /etc/idempotency/auth-policy
policyFile: /etc/idempotency/auth-policy/policy.toml
jwks: /etc/idempotency/jwks
jwksFile: /etc/idempotency/jwks/jwks.json
staticTokens: /etc/idempotency/static-tokens
staticTokensFile: /etc/idempotency/static-tokens/tokens.toml
{{- end }}

{{/*
The Postgres URL as a file (DATABASE_URL_FILE), never as an environment
variable: the password then shows in neither the pod spec nor the process's
environment. The Secret is the chart's (database.url), another one passed as
"secret" (the migration hook's copy), or database.existingSecret. Call with
(dict "ctx" $ "secret" NAME); "databaseEnv", "databaseVolumeMount" and
"databaseVolume" go together.
*/}}
{{- define "idempotency.databaseEnv" -}}
- name: DATABASE_URL_FILE
  value: {{ (include "idempotency.paths" .ctx | fromYaml).databaseFile | quote }}
{{- end }}

{{- define "idempotency.databaseVolumeMount" -}}
- name: database
  mountPath: {{ (include "idempotency.paths" .ctx | fromYaml).database }}
  readOnly: true
{{- end }}

{{- define "idempotency.databaseVolume" -}}
{{- $ctx := .ctx }}
{{- $db := $ctx.Values.database }}
- name: database
  secret:
{{- if $db.url }}
    secretName: {{ default (include "idempotency.databaseSecretName" $ctx) .secret }}
    items:
      - key: DATABASE_URL
        path: url
{{- else if $db.existingSecret }}
    secretName: {{ $db.existingSecret }}
    items:
      - key: {{ required "database.existingSecretKey is required with database.existingSecret" $db.existingSecretKey }}
        path: url
{{- else }}
{{- fail "set database.url (the chart creates a Secret) or database.existingSecret (a Secret holding the URL)" }}
{{- end }}
    # Owner and group (fsGroup) may read it, others may not.
    defaultMode: 0440
{{- end }}

{{/* Name of the kubernetes.io/tls Secret of the gRPC port. */}}
{{- define "idempotency.tlsSecretName" -}}
{{- default (printf "%s-tls" (include "idempotency.fullname" .)) .Values.tls.secretName }}
{{- end }}

{{/* Name of the ConfigMap holding the auth policy: the chart's (auth.policy.inline) or an existing one. */}}
{{- define "idempotency.policyConfigMapName" -}}
{{- default (printf "%s-auth-policy" (include "idempotency.fullname" .)) .Values.auth.policy.existingConfigMap }}
{{- end }}

{{/* Name of the ConfigMap holding the JWKS: the chart's (auth.jwt.jwks.inline) or an existing one. */}}
{{- define "idempotency.jwksConfigMapName" -}}
{{- default (printf "%s-jwks" (include "idempotency.fullname" .)) .Values.auth.jwt.jwks.existingConfigMap }}
{{- end }}

{{/* "true" when a credential method is on (client certificates, JWTs, static tokens), else empty. */}}
{{- define "idempotency.authOn" -}}
{{- if or (and .Values.tls.enabled .Values.tls.clientAuth.enabled) .Values.auth.jwt.enabled .Values.auth.staticTokens.existingSecret }}true{{ end }}
{{- end }}

{{/*
The server's security files: volume mounts and volumes (Deployment only; the
migration Job and the reaper serve nothing). The policy, JWKS and tokens are
not part of the pods' checksum annotations on purpose: the server re-reads
them (and the certificate) every config.reloadInterval, so a change applies
without restarting a pod.
*/}}
{{- define "idempotency.securityVolumeMounts" -}}
{{- $p := include "idempotency.paths" . | fromYaml }}
{{- $ca := .Values.tls.clientAuth.ca }}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ $p.tls }}
  readOnly: true
{{- if and .Values.tls.clientAuth.enabled (or $ca.configMap $ca.secret) }}
- name: client-ca
  mountPath: {{ $p.clientCa }}
  readOnly: true
{{- end }}
{{- end }}
{{- if include "idempotency.authOn" . }}
- name: auth-policy
  mountPath: {{ $p.policy }}
  readOnly: true
{{- end }}
{{- if .Values.auth.jwt.enabled }}
- name: jwks
  mountPath: {{ $p.jwks }}
  readOnly: true
{{- end }}
{{- if .Values.auth.staticTokens.existingSecret }}
- name: static-tokens
  mountPath: {{ $p.staticTokens }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "idempotency.securityVolumes" -}}
{{- $ca := .Values.tls.clientAuth.ca }}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "idempotency.tlsSecretName" . }}
    items:
      - key: tls.crt
        path: tls.crt
      - key: tls.key
        path: tls.key
      {{- if and .Values.tls.clientAuth.enabled (not (or $ca.configMap $ca.secret)) }}
      - key: {{ $ca.key }}
        path: ca.crt
      {{- end }}
    # Owner and group (fsGroup) may read the key, others may not.
    defaultMode: 0440
{{- if and .Values.tls.clientAuth.enabled $ca.configMap }}
- name: client-ca
  configMap:
    name: {{ $ca.configMap }}
    items:
      - key: {{ $ca.key }}
        path: ca.crt
{{- else if and .Values.tls.clientAuth.enabled $ca.secret }}
- name: client-ca
  secret:
    secretName: {{ $ca.secret }}
    items:
      - key: {{ $ca.key }}
        path: ca.crt
{{- end }}
{{- end }}
{{- if include "idempotency.authOn" . }}
- name: auth-policy
  configMap:
    name: {{ include "idempotency.policyConfigMapName" . }}
    items:
      - key: {{ .Values.auth.policy.key }}
        path: policy.toml
{{- end }}
{{- if .Values.auth.jwt.enabled }}
- name: jwks
  configMap:
    name: {{ include "idempotency.jwksConfigMapName" . }}
    items:
      - key: {{ .Values.auth.jwt.jwks.key }}
        path: jwks.json
{{- end }}
{{- with .Values.auth.staticTokens.existingSecret }}
- name: static-tokens
  secret:
    secretName: {{ . }}
    items:
      - key: {{ $.Values.auth.staticTokens.key }}
        path: tokens.toml
    # Owner and group (fsGroup) may read the hashes, others may not.
    defaultMode: 0440
{{- end }}
{{- end }}

{{/*
The service's settings as IDEMPOTENCY_* variables (the ConfigMap's data).
Listen addresses follow ports; the reaper is turned off in process when the
CronJob reaps; the security settings name the files the Deployment mounts
(idempotency.securityVolumes).
*/}}
{{- define "idempotency.settings" -}}
{{- $c := .Values.config }}
{{- $r := .Values.reaper }}
{{- $p := include "idempotency.paths" . | fromYaml }}
IDEMPOTENCY_GRPC_ADDR: {{ printf "0.0.0.0:%d" (int .Values.ports.grpc) | quote }}
IDEMPOTENCY_METRICS_ADDR: {{ printf "0.0.0.0:%d" (int .Values.ports.metrics) | quote }}
IDEMPOTENCY_HEALTH_ADDR: {{ printf "0.0.0.0:%d" (int .Values.ports.health) | quote }}
IDEMPOTENCY_REFLECTION: {{ $c.reflection | toString | quote }}
IDEMPOTENCY_RELOAD_INTERVAL: {{ $c.reloadInterval | quote }}
{{- if .Values.tls.enabled }}
IDEMPOTENCY_TLS_CERT: {{ $p.tlsCert | quote }}
IDEMPOTENCY_TLS_KEY: {{ $p.tlsKey | quote }}
{{- if .Values.tls.clientAuth.enabled }}
{{- /* From its own volume, or key ca.crt of the TLS Secret's. */}}
{{- $ca := .Values.tls.clientAuth.ca }}
IDEMPOTENCY_TLS_CLIENT_CA: {{ if or $ca.configMap $ca.secret }}{{ $p.clientCaFile | quote }}{{ else }}{{ printf "%s/ca.crt" $p.tls | quote }}{{ end }}
{{- end }}
{{- end }}
{{- if .Values.auth.jwt.enabled }}
IDEMPOTENCY_JWT_JWKS: {{ $p.jwksFile | quote }}
IDEMPOTENCY_JWT_ISSUER: {{ .Values.auth.jwt.issuer | quote }}
IDEMPOTENCY_JWT_AUDIENCE: {{ .Values.auth.jwt.audience | quote }}
{{- end }}
{{- if .Values.auth.staticTokens.existingSecret }}
IDEMPOTENCY_STATIC_TOKENS: {{ $p.staticTokensFile | quote }}
{{- end }}
{{- if include "idempotency.authOn" . }}
IDEMPOTENCY_AUTH_POLICY: {{ $p.policyFile | quote }}
{{- end }}
IDEMPOTENCY_MIGRATE: {{ $c.migrateOnStart | toString | quote }}
{{- if gt (int64 $c.workerThreads) 0 }}
IDEMPOTENCY_WORKER_THREADS: {{ int64 $c.workerThreads | toString | quote }}
{{- end }}
IDEMPOTENCY_BATCHING: {{ $c.batching | toString | quote }}
IDEMPOTENCY_BATCH_WORKERS: {{ int64 $c.batchWorkers | toString | quote }}
IDEMPOTENCY_BATCH_OVERLAP_AFTER: {{ $c.batchOverlapAfter | quote }}
IDEMPOTENCY_BATCH_MAX_SIZE: {{ int64 $c.batchMaxSize | toString | quote }}
IDEMPOTENCY_DEFAULT_TTL: {{ $c.defaultTtl | quote }}
IDEMPOTENCY_MAX_TTL: {{ $c.maxTtl | quote }}
IDEMPOTENCY_DEFAULT_LEASE: {{ $c.defaultLease | quote }}
IDEMPOTENCY_MAX_LEASE: {{ $c.maxLease | quote }}
IDEMPOTENCY_MAX_RESPONSE_BYTES: {{ int64 $c.maxResponseBytes | toString | quote }}
IDEMPOTENCY_MAX_BATCH_ITEMS: {{ int64 $c.maxBatchItems | toString | quote }}
IDEMPOTENCY_MAX_RESPONSE_HEADERS: {{ int64 $c.maxResponseHeaders | toString | quote }}
IDEMPOTENCY_MAX_IN_FLIGHT_BYTES: {{ int64 $c.maxInFlightBytes | toString | quote }}
IDEMPOTENCY_REQUEST_TIMEOUT: {{ $c.requestTimeout | quote }}
IDEMPOTENCY_REPLAY_CACHE_BYTES: {{ int64 $c.replayCacheBytes | toString | quote }}
IDEMPOTENCY_REPLAY_CACHE_MAX_AGE: {{ $c.replayCacheMaxAge | quote }}
IDEMPOTENCY_MAX_CONNECTIONS: {{ int64 $c.maxConnections | toString | quote }}
IDEMPOTENCY_HANDSHAKE_TIMEOUT: {{ $c.handshakeTimeout | quote }}
IDEMPOTENCY_MAX_CONCURRENT_STREAMS: {{ int64 $c.maxConcurrentStreams | toString | quote }}
IDEMPOTENCY_MAX_CONCURRENT_CALLS: {{ int64 $c.maxConcurrentCalls | toString | quote }}
IDEMPOTENCY_MAX_STREAMS: {{ int64 $c.maxStreams | toString | quote }}
IDEMPOTENCY_STREAM_MAX_PER_CONNECTION: {{ int64 $c.streamMaxPerConnection | toString | quote }}
IDEMPOTENCY_STREAM_MAX_PER_PRINCIPAL: {{ int64 $c.streamMaxPerPrincipal | toString | quote }}
IDEMPOTENCY_STREAM_MAX_IN_FLIGHT: {{ int64 $c.streamMaxInFlight | toString | quote }}
IDEMPOTENCY_STREAM_IDLE_TIMEOUT: {{ $c.streamIdleTimeout | quote }}
IDEMPOTENCY_STREAM_MAX_AGE: {{ $c.streamMaxAge | quote }}
IDEMPOTENCY_HTTP2_KEEPALIVE_INTERVAL: {{ $c.http2KeepaliveInterval | quote }}
IDEMPOTENCY_HTTP2_KEEPALIVE_TIMEOUT: {{ $c.http2KeepaliveTimeout | quote }}
IDEMPOTENCY_HTTP2_MAX_PENDING_RESET_STREAMS: {{ int64 $c.http2MaxPendingResetStreams | toString | quote }}
IDEMPOTENCY_HTTP2_MAX_LOCAL_ERROR_RESET_STREAMS: {{ int64 $c.http2MaxLocalErrorResetStreams | toString | quote }}
IDEMPOTENCY_DB_MAX_CONNECTIONS: {{ int64 $c.dbMaxConnections | toString | quote }}
IDEMPOTENCY_DB_ACQUIRE_TIMEOUT: {{ $c.dbAcquireTimeout | quote }}
IDEMPOTENCY_STATEMENT_TIMEOUT: {{ $c.statementTimeout | quote }}
IDEMPOTENCY_HEALTH_CHECK_INTERVAL: {{ $c.healthCheckInterval | quote }}
IDEMPOTENCY_DRAIN_TIMEOUT: {{ $c.drainTimeout | quote }}
IDEMPOTENCY_LOG_LEVEL: {{ $c.logLevel | quote }}
IDEMPOTENCY_LOG_FORMAT: {{ $c.logFormat | quote }}
IDEMPOTENCY_LOG_CALLS: {{ $c.logCalls | toString | quote }}
{{- with $c.otlpEndpoint }}
IDEMPOTENCY_OTLP_ENDPOINT: {{ . | quote }}
{{- end }}
IDEMPOTENCY_STATS_INTERVAL: {{ $c.statsInterval | quote }}
IDEMPOTENCY_METRICS_MAX_NAMESPACES: {{ int64 $c.metricsMaxNamespaces | toString | quote }}
IDEMPOTENCY_REAPER_ENABLED: {{ not $r.cronJob.enabled | toString | quote }}
IDEMPOTENCY_REAPER_INTERVAL: {{ $r.interval | quote }}
IDEMPOTENCY_REAPER_BATCH_SIZE: {{ int64 $r.batchSize | toString | quote }}
IDEMPOTENCY_REAPER_BATCH_PAUSE: {{ $r.batchPause | quote }}
IDEMPOTENCY_REAPER_MAX_PER_RUN: {{ int64 $r.maxPerRun | toString | quote }}
{{- end }}

{{/*
Seconds in a duration of one unit ("20s", "1m", "500ms"), rounded up; -1 when the value
has another form (the drain check below is then skipped).
*/}}
{{- define "idempotency.durationSeconds" -}}
{{- $m := regexFind "^[0-9]+(ms|s|m|h)$" . }}
{{- if not $m }}-1
{{- else }}
{{- $n := regexFind "^[0-9]+" . | int64 }}
{{- $unit := regexFind "[a-z]+$" . }}
{{- if eq $unit "ms" }}{{ div (add $n 999) 1000 }}
{{- else if eq $unit "s" }}{{ $n }}
{{- else if eq $unit "m" }}{{ mul $n 60 }}
{{- else }}{{ mul $n 3600 }}
{{- end }}
{{- end }}
{{- end }}

{{/* Refuses a pool the batch workers would fill: each keeps a connection, and the server would refuse to start. */}}
{{- define "idempotency.checkPool" -}}
{{- $kept := mul 2 (max 1 (int .Values.config.batchWorkers)) }}
{{- if and .Values.config.batching (le (int .Values.config.dbMaxConnections) $kept) }}
{{- fail (printf "config.dbMaxConnections (%d) must be more than %d (2 x config.batchWorkers) with config.batching on: each batch worker keeps a connection" (int .Values.config.dbMaxConnections) $kept) }}
{{- end }}
{{- end }}

{{/* Refuses a grace period that would SIGKILL pods before they drain. */}}
{{- define "idempotency.checkGracePeriod" -}}
{{- $drain := include "idempotency.durationSeconds" .Values.config.drainTimeout | int64 }}
{{- if and (ge $drain 0) (le (int64 .Values.terminationGracePeriodSeconds) $drain) }}
{{- fail (printf "terminationGracePeriodSeconds (%d) must exceed config.drainTimeout (%s): pods would be killed while draining" (int64 .Values.terminationGracePeriodSeconds) .Values.config.drainTimeout) }}
{{- end }}
{{- end }}

{{/* The container security context and the image settings every idempotencyd container shares. */}}
{{- define "idempotency.containerCommon" -}}
image: {{ include "idempotency.image" . | quote }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
securityContext:
  {{- toYaml .Values.securityContext | nindent 2 }}
{{- end }}

{{/* Pod-level settings every idempotencyd pod shares. */}}
{{- define "idempotency.podCommon" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- end }}

{{/*
Refuses security settings the server would refuse, or that would leave it
open or unreachable without saying so.
*/}}
{{- define "idempotency.checkSecurity" -}}
{{- $tls := .Values.tls }}
{{- $auth := .Values.auth }}
{{- $ports := list (int .Values.ports.grpc) (int .Values.ports.metrics) (int .Values.ports.health) }}
{{- if ne (len ($ports | uniq)) 3 }}
{{- fail (printf "ports.grpc (%d), ports.metrics (%d) and ports.health (%d) must differ" (int .Values.ports.grpc) (int .Values.ports.metrics) (int .Values.ports.health)) }}
{{- end }}
{{- if and $tls.clientAuth.enabled (not $tls.enabled) }}
{{- fail "tls.clientAuth.enabled needs tls.enabled: client certificates are only presented over TLS" }}
{{- end }}
{{- if and $tls.clientAuth.ca.configMap $tls.clientAuth.ca.secret }}
{{- fail "set at most one of tls.clientAuth.ca.configMap and tls.clientAuth.ca.secret" }}
{{- end }}
{{- if and $tls.certManager.enabled (not $tls.enabled) }}
{{- fail "tls.certManager.enabled needs tls.enabled: the certificate would be issued but not served" }}
{{- end }}
{{- if and $tls.certManager.enabled (not $tls.certManager.issuerRef.name) }}
{{- fail "tls.certManager.issuerRef.name is required with tls.certManager.enabled: the Issuer or ClusterIssuer that signs the certificate" }}
{{- end }}
{{- if and $tls.enabled (not $tls.certManager.enabled) (not $tls.secretName) }}
{{- fail "tls.enabled needs tls.secretName (an existing kubernetes.io/tls Secret) or tls.certManager.enabled (the chart has cert-manager issue one)" }}
{{- end }}
{{- if $auth.jwt.enabled }}
{{- if or (not $auth.jwt.issuer) (not $auth.jwt.audience) }}
{{- fail "auth.jwt.enabled needs auth.jwt.issuer and auth.jwt.audience: tokens are only accepted for one issuer and one audience" }}
{{- end }}
{{- if eq (ternary 1 0 (ne $auth.jwt.jwks.inline "")) (ternary 1 0 (ne $auth.jwt.jwks.existingConfigMap "")) }}
{{- fail "auth.jwt.enabled needs exactly one of auth.jwt.jwks.inline and auth.jwt.jwks.existingConfigMap" }}
{{- end }}
{{- with $auth.jwt.jwks.inline }}
{{- $jwks := fromJson . }}
{{- if or (hasKey $jwks "Error") (not (kindIs "slice" $jwks.keys)) (not $jwks.keys) }}
{{- fail "auth.jwt.jwks.inline is not a JWKS: a JSON object with a non-empty \"keys\" list (kubectl get --raw /openid/v1/jwks)" }}
{{- end }}
{{- end }}
{{- end }}
{{- if and $auth.policy.inline $auth.policy.existingConfigMap }}
{{- fail "set at most one of auth.policy.inline and auth.policy.existingConfigMap" }}
{{- end }}
{{- $hasPolicy := or $auth.policy.inline $auth.policy.existingConfigMap }}
{{- if and (include "idempotency.authOn" .) (not $hasPolicy) }}
{{- fail "auth.policy (inline or existingConfigMap) is required once tls.clientAuth, auth.jwt or auth.staticTokens is on: it says which callers may use which namespaces, and the server refuses to start without it" }}
{{- end }}
{{- if and $hasPolicy (not (include "idempotency.authOn" .)) }}
{{- fail "auth.policy is set but no caller can prove who it is: turn on tls.clientAuth, auth.jwt or auth.staticTokens" }}
{{- end }}
{{- with $auth.policy.inline }}
{{- $policy := fromToml . }}
{{- if hasKey $policy "Error" }}
{{- fail (printf "auth.policy.inline is not valid TOML: %s" $policy.Error) }}
{{- end }}
{{- if not (kindIs "slice" ($policy.grant | default list)) }}
{{- fail "auth.policy.inline: grant must be an array of tables ([[grant]])" }}
{{- end }}
{{- range $i, $grant := $policy.grant | default list }}
{{- if not (kindIs "map" $grant) }}
{{- fail (printf "auth.policy.inline: grant %d is not a table" (add1 $i)) }}
{{- end }}
{{- if or (not (kindIs "slice" $grant.principals)) (not $grant.principals) (not (kindIs "slice" $grant.namespaces)) (not $grant.namespaces) }}
{{- fail (printf "auth.policy.inline: grant %d needs non-empty lists principals and namespaces" (add1 $i)) }}
{{- end }}
{{- if not (has $grant.role (list "caller" "reader" "admin")) }}
{{- fail (printf "auth.policy.inline: grant %d has role %v; the roles are caller, reader and admin" (add1 $i) $grant.role) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and (or $auth.jwt.enabled $auth.staticTokens.existingSecret) (not $tls.enabled) (not $auth.allowTokensWithoutTls) }}
{{- fail "auth.jwt and auth.staticTokens need tls.enabled: bearer tokens would cross the network in clear text (set auth.allowTokensWithoutTls when a service mesh encrypts the traffic)" }}
{{- end }}
{{- end }}
