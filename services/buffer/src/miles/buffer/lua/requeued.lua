-- PullRequeued. ARGV: 1 max prompts. Pops (at most once) the oldest requeued prompts.
-- Returns {status, then per prompt: group_id, prompt_index, epoch}; status NOJOB|OK.
if not job_exists() then
  return {'NOJOB'}
end
local reply = {'OK'}
local items = redis.call('LPOP', K_REQUEUED, tonumber(ARGV[1]))
if items then
  for _, item in ipairs(items) do
    local gid, prompt_index, epoch = cmsgpack.unpack(item)
    reply[#reply + 1] = gid
    reply[#reply + 1] = prompt_index
    reply[#reply + 1] = epoch
  end
end
return reply
