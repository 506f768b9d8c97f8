-- Returns groups of expired leases to the queue. ARGV: 1 reap limit. Returns {status, num_expired}.
if not job_exists() then
  return {'NOJOB', 0}
end
return {'OK', reap_expired(now_ms(), tonumber(ARGV[1]))}
