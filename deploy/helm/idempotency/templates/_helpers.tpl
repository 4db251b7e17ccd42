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
The DATABASE_URL environment variable, from the chart's Secret (database.url)
or from database.existingSecret. Pass (dict "ctx" $ "secret" NAME) to read the
chart's URL from another Secret (the migration hook's).
*/}}
{{- define "idempotency.databaseUrlEnv" -}}
{{- $ctx := .ctx }}
{{- $db := $ctx.Values.database }}
- name: DATABASE_URL
  valueFrom:
    secretKeyRef:
{{- if $db.url }}
      name: {{ default (include "idempotency.databaseSecretName" $ctx) .secret }}
      key: DATABASE_URL
{{- else if $db.existingSecret }}
      name: {{ $db.existingSecret }}
      key: {{ required "database.existingSecretKey is required with database.existingSecret" $db.existingSecretKey }}
{{- else }}
{{- fail "set database.url (the chart creates a Secret) or database.existingSecret (a Secret holding DATABASE_URL)" }}
{{- end }}
{{- end }}

{{/*
The service's settings as IDEMPOTENCY_* variables (the ConfigMap's data).
Listen addresses follow ports; the reaper is turned off in process when the
CronJob reaps.
*/}}
{{- define "idempotency.settings" -}}
{{- $c := .Values.config }}
{{- $r := .Values.reaper }}
IDEMPOTENCY_GRPC_ADDR: {{ printf "0.0.0.0:%d" (int .Values.ports.grpc) | quote }}
IDEMPOTENCY_METRICS_ADDR: {{ printf "0.0.0.0:%d" (int .Values.ports.metrics) | quote }}
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
IDEMPOTENCY_REPLAY_CACHE_BYTES: {{ int64 $c.replayCacheBytes | toString | quote }}
IDEMPOTENCY_REPLAY_CACHE_MAX_AGE: {{ $c.replayCacheMaxAge | quote }}
IDEMPOTENCY_DB_MAX_CONNECTIONS: {{ int64 $c.dbMaxConnections | toString | quote }}
IDEMPOTENCY_DB_ACQUIRE_TIMEOUT: {{ $c.dbAcquireTimeout | quote }}
IDEMPOTENCY_STATEMENT_TIMEOUT: {{ $c.statementTimeout | quote }}
IDEMPOTENCY_HEALTH_CHECK_INTERVAL: {{ $c.healthCheckInterval | quote }}
IDEMPOTENCY_DRAIN_TIMEOUT: {{ $c.drainTimeout | quote }}
IDEMPOTENCY_LOG_LEVEL: {{ $c.logLevel | quote }}
IDEMPOTENCY_LOG_FORMAT: {{ $c.logFormat | quote }}
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
